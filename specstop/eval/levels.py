"""Exact greedy replay of multi-level speculation, its pricing and the joint tuning of its policies.

A multi-level stack (:class:`~specstop.decode.multilevel.MultiLevelDecoder`: a small draft speculating
for a middle model, which speculates for the target) is deterministic under greedy decoding: which tokens
each level proposes, how many each verification accepts and which forwards every model runs follow from
the models' argmax (and, for confidence rules, top-1 probability) at the prefixes the rounds reach.
:class:`LevelRecord` holds exactly those, per prompt, for every prefix the recorded policies reach
(:mod:`specstop.measure.level_record` runs this module's rounds with the models answering what the record
lacks), so :func:`replay_levels` re-runs the decoder's rounds on the record without a model, for each
recorded combination of rules (and any other whose rounds stay on recorded prefixes):

* the target's rounds start on its own greedy path ``y``; the middle model's tokens are its greedy
  continuation of the round's prefix, produced by its own rounds, in which the bottom draft proposes its
  greedy continuation and the middle accepts the leading tokens equal to its own;
* each level's policy reads the drafting level's top-1 probability (static, heuristic, confidence and
  cumulative confidence rules: :class:`~specstop.policy.RoundPolicy`), EOS ends a level's tokens, and a
  middle block the top policy stops inside is dropped, as in the decoder;
* every model's KV cache is followed token for token (cut to the longest prefix shared with what it is
  fed next), so each forward is priced by the number of tokens it really feeds: ``t_level(rows)`` of a
  :class:`LevelCost` measured on the machine (:mod:`specstop.measure.level_cost`).

The predicted speedup of a prompt is ``N * t_target(1 row) / (the forwards' seconds + the policies' own
per-step seconds)``, the decode phase only (the prompt's prefill is left out, as in every replay).
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specstop.cache_prefix import cached_prefix
from specstop.errors import UserError
from specstop.policy import PolicySpec, RoundPolicy, StepFeatures, parse_policy_string

__all__ = ["LevelCost", "LevelRecord", "LevelReplay", "level_combos", "level_grid", "load_records", "replay_levels",
           "save_records", "tune_levels"]


@dataclass
class LevelRecord:
    """One prompt's greedy tokens of a stack of models, bottom first, the target last.

    Attributes:
        prompt_id: the prompt's name.
        prompt: the rendered prompt's token ids.
        budget: the response budget (max new tokens) the record covers.
        path: the target's greedy response ``y`` (``[N]``, EOS included when reached).
        steps: per level below the target, ``{response prefix: (argmax, top-1 probability)}``: the model's
            greedy next token after ``prompt + prefix`` and the probability it gives it (softmax over the
            shared vocabulary).
        eos: the ids that end a response.
        policies: the combinations of rules (bottom first) the record was made for.
    """

    prompt_id: str
    prompt: list[int]
    budget: int
    path: list[int]
    steps: list[dict[tuple, tuple[int, float]]]
    eos: list[int] = field(default_factory=list)
    policies: list[list[str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"prompt_id": self.prompt_id, "prompt": self.prompt, "budget": self.budget, "path": self.path,
                "eos": self.eos, "policies": self.policies,
                "steps": [[[list(k), v[0], v[1]] for k, v in level.items()] for level in self.steps]}

    @classmethod
    def from_dict(cls, d: dict) -> LevelRecord:
        steps = [{tuple(k): (int(a), float(p)) for k, a, p in level} for level in d["steps"]]
        return cls(str(d["prompt_id"]), list(d["prompt"]), int(d["budget"]), list(d["path"]), steps,
                   list(d.get("eos", [])), [list(c) for c in d.get("policies", [])])


def save_records(path: str | Path, records: list[LevelRecord], meta: dict) -> None:
    """Write ``records`` with ``meta`` (the stack's models, the decoding) as one JSON file."""
    Path(path).write_text(json.dumps({"meta": meta, "records": [r.to_dict() for r in records]}))


def load_records(path: str | Path) -> tuple[list[LevelRecord], dict]:
    """Read a file of :func:`save_records`."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not a multi-level record ({err}); record one with benchmarks/multi_level.py") from None
    return [LevelRecord.from_dict(r) for r in doc["records"]], doc.get("meta", {})


@dataclass
class LevelCost:
    """Seconds of one forward of each model of a stack by the number of tokens it feeds.

    Attributes:
        names: the levels, bottom first (the target last).
        forward: per level, ``{rows: seconds}`` measured at ``context_tokens`` of context.
        policy_step: seconds a distribution-reading rule spends per drafted token (softmax and top-1).
        machine: where it was measured.
        context_tokens: the context length of the timings.
    """

    names: list[str]
    forward: list[dict[int, float]]
    policy_step: float = 0.0
    machine: dict | None = None
    context_tokens: int = 0

    def __post_init__(self) -> None:
        self.forward = [{int(r): float(s) for r, s in table.items()} for table in self.forward]

    def seconds(self, level: int, rows: int) -> float:
        """One forward of ``level`` over ``rows`` tokens: the table's, linear between and beyond its rows."""
        table = self.forward[level]
        xs = np.array(sorted(table), dtype=np.float64)
        ys = np.array([table[int(x)] for x in xs])
        if rows > xs[-1] and len(xs) > 1:  # past the table: extend its last segment
            return float(ys[-1] + (rows - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return float(np.interp(rows, xs, ys))

    def to_dict(self) -> dict:
        return {"names": self.names, "forward": self.forward, "policy_step": self.policy_step,
                "machine": self.machine, "context_tokens": self.context_tokens}

    @classmethod
    def from_dict(cls, d: dict) -> LevelCost:
        return cls(list(d["names"]), list(d["forward"]), float(d.get("policy_step", 0.0)), d.get("machine"),
                   int(d.get("context_tokens", 0)))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LevelCost:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError) as err:
            raise UserError(f"{path}: not a level cost file ({err}); time one with benchmarks/multi_level.py") from None


@dataclass
class LevelReplay:
    """The replay of one pair of policies on a set of records.

    Attributes:
        speedup: median over prompts of the predicted decode-phase speedup over the target alone.
        per_prompt: each prompt's predicted speedup.
        tokens: each prompt's emitted tokens.
        tokens_per_round: per level above the bottom, tokens it emitted per round (accepted + its own).
        rounds: per level, rounds run (the bottom's: 0; all prompts).
        drafted: per level, tokens drafted for it by the level below (all prompts).
        accepted: per level, those it accepted.
        forwards: per level, forwards run (all prompts).
        seconds: per level, the forwards' priced seconds (all prompts); the policies' seconds last.
    """

    speedup: float
    per_prompt: list[float]
    tokens: list[int]
    tokens_per_round: list[float]
    rounds: list[int]
    drafted: list[int]
    accepted: list[int]
    forwards: list[int]
    seconds: list[float]


class _Sim:
    """The decoder's rounds on one record (see the module docstring): tokens, forwards and their rows."""

    def __init__(self, rec: LevelRecord, specs: list[PolicySpec], cost: LevelCost | None, fill=None) -> None:
        """``fill(level, prompt + prefix) -> (argmax, top1)``: asked for what the record lacks (recording);
        None: a missing prefix is an error (replay)."""
        self.rec, self.cost, self.fill = rec, cost, fill
        self.policies = [RoundPolicy(s) for s in specs]
        self.reads = [s.kind == "confidence" for s in specs]
        n_levels = len(specs) + 1
        self.cached = [list(rec.prompt[:-1]) if len(rec.prompt) > 1 else [] for _ in range(n_levels)]
        self.forwards = [0] * n_levels
        self.seconds = [0.0] * (n_levels + 1)
        self.rounds = [0] * n_levels
        self.drafted = [0] * n_levels
        self.accepted = [0] * n_levels
        self.eos = set(rec.eos)
        self.top = n_levels - 1

    def _feed(self, level: int, seq: list[int], keep: int) -> None:
        """Price one forward of ``level`` that leaves its cache holding ``seq`` (as ``_Level.logits``)."""
        rows = len(seq) - cached_prefix(self.cached[level], seq, keep)
        self.forwards[level] += 1
        if self.cost is not None:
            self.seconds[level] += self.cost.seconds(level, rows)
        self.cached[level] = list(seq)

    def _next(self, level: int, resp: list[int]) -> tuple[int, float]:
        """``level``'s greedy token (and its top-1 probability) after the response prefix ``resp``."""
        if level == self.top:
            if len(resp) >= len(self.rec.path):  # past the path's EOS: the decoder cuts its block there
                return self.rec.path[-1], 1.0
            return self.rec.path[len(resp)], 1.0
        key = tuple(resp)
        step = self.rec.steps[level].get(key)
        if step is None:
            if self.fill is None:
                made = ", ".join(" / ".join(c) for c in self.rec.policies) or "none"
                raise UserError(f"prompt {self.rec.prompt_id}: these policies reach a prefix the record lacks (it "
                                f"was made for {made}): record them too (benchmarks/multi_level.py --bottom / --top)")
            step = self.rec.steps[level][key] = self.fill(level, self.rec.prompt + resp)
        return step

    def _tokens(self, level: int, resp: list[int], cap: int, pol: RoundPolicy | None, reads: bool) -> list[int]:
        """Up to ``cap`` tokens of ``level`` after ``resp`` (``MultiLevelDecoder._tokens``)."""
        tokens: list[int] = []
        while len(tokens) < cap:
            here = resp + tokens
            if level == 0:
                self._feed(0, self.rec.prompt + here, 1)
                block = [self._next(0, here)]
            else:
                block = self._round(level, here, cap - len(tokens))
            for tok, top1 in block:
                tokens.append(tok)
                stop = False
                if pol is not None:
                    if reads and self.cost is not None:
                        self.seconds[-1] += self.cost.policy_step
                    position = len(resp) + len(tokens) - 1  # 0-based response position of this token
                    stop = pol.should_stop(StepFeatures(j=len(tokens), position=position, top1=top1))
                if stop or tok in self.eos or len(tokens) >= cap:
                    return tokens
        return tokens

    def _round(self, level: int, resp: list[int], room: int) -> list[tuple[int, float]]:
        """One round of ``level``: its emitted tokens with its top-1 probability at each."""
        pol = self.policies[level - 1]
        k_cap = min(pol.cap(), room - 1)
        self.rounds[level] += 1
        if k_cap <= 0:
            self._feed(level, self.rec.prompt + resp, 1)
            return [self._next(level, resp)]
        pol.reset()
        drafted = self._tokens(level - 1, resp, k_cap, pol, self.reads[level - 1])
        k = len(drafted)
        self._feed(level, self.rec.prompt + resp + drafted, k + 1)
        out = []
        for j in range(k + 1):
            tok, top1 = self._next(level, resp + drafted[:j])
            out.append((tok, top1))
            if j == k or drafted[j] != tok:
                break
        n = len(out) - 1
        pol.end_round(k, n)
        self.drafted[level] += k
        self.accepted[level] += n
        return out

    def run(self, budget: int) -> int:
        """Decode ``budget`` tokens (or up to EOS); returns the tokens emitted."""
        out: list[int] = []
        while len(out) < budget and not (out and out[-1] in self.eos):
            block = [t for t, _ in self._round(self.top, out, budget - len(out))]
            for i, tok in enumerate(block):
                if tok in self.eos:
                    block = block[: i + 1]
                    break
            out.extend(block)
        if out != self.rec.path[: len(out)]:  # greedy is lossless: anything else is a bug of this replay
            raise AssertionError(f"prompt {self.rec.prompt_id}: the replayed stack left the target's greedy path")
        return len(out)


def _spec(policy: str | PolicySpec) -> PolicySpec:
    spec = parse_policy_string(policy) if isinstance(policy, str) else policy
    if spec.kind not in ("static", "heuristic", "confidence"):
        raise UserError(f"policy {spec.label}: the multi-level replay runs rules (static:K, heuristic, "
                        "confidence:T, cumulative confidence), not learned policies")
    return spec


def replay_levels(records: list[LevelRecord], policies: list[str | PolicySpec], cost: LevelCost | None = None,
                  budget: int | None = None, *, fill=None) -> LevelReplay:
    """Replay the stack with ``policies`` (one per gap, bottom first) on every record and price it.

    Args:
        records: one per prompt, from :func:`specstop.measure.level_record.record_levels`.
        policies: rules, bottom first (``static:3``, ``confidence:0.6`` or their PolicySpecs).
        cost: the stack's measured forward costs; None: count only (speedups come back 0).
        budget: tokens per prompt (at most the records'); default each record's budget.
        fill: ``fill(level, ids) -> (argmax, top1)`` answers the prefixes a record lacks and stores them
            there (:mod:`specstop.measure.level_record`); None: a missing prefix raises.

    Raises:
        UserError: a policy or budget the records do not cover.
    """
    specs = [_spec(p) for p in policies]
    ratios, toks = [], []
    totals = {key: [0] * (len(specs) + 1) for key in ("forwards", "rounds", "drafted", "accepted")}
    seconds = [0.0] * (len(specs) + 2)
    for rec in records:
        if len(rec.steps) != len(specs):
            raise UserError(f"the records hold a stack of {len(rec.steps) + 1} models; give {len(rec.steps)} "
                            f"policies, bottom first (got {len(specs)})")
        n_budget = rec.budget if budget is None else int(budget)
        if n_budget > rec.budget:
            raise UserError(f"budget {n_budget} is past the record's {rec.budget} tokens")
        sim = _Sim(rec, specs, cost, fill)
        n = sim.run(n_budget)
        toks.append(n)
        if cost is not None:
            ratios.append(n * cost.seconds(sim.top, 1) / max(sum(sim.seconds), 1e-12))
        for key, values in totals.items():
            totals[key] = [a + b for a, b in zip(values, getattr(sim, key))]
        seconds = [a + b for a, b in zip(seconds, sim.seconds)]
    per_round = [(a + r) / max(r, 1) for a, r in zip(totals["accepted"][1:], totals["rounds"][1:])]
    return LevelReplay(float(statistics.median(ratios)) if ratios else 0.0, ratios, toks, per_round,
                       seconds=seconds, **totals)


def level_grid(values: str) -> list[str]:
    """Rules of a comma list, e.g. ``static:1,static:2,confidence:0.5`` (each checked)."""
    out = [v.strip() for v in values.split(",") if v.strip()]
    for v in out:
        _spec(v)
    if not out:
        raise UserError("give at least one rule, e.g. static:2,confidence:0.6")
    return out


def level_combos(grids: list[list[str]]) -> list[list[str]]:
    """Every combination of the grids' rules, one per gap, bottom first (what a tuning records and replays)."""
    return [list(c) for c in itertools.product(*grids)]


def tune_levels(records: list[LevelRecord], grids: list[list[str]], cost: LevelCost) -> list[dict]:
    """Every combination of the grids' rules (one grid per gap, bottom first), replayed and priced on
    ``records``; best predicted speedup first: ``[{"policies": [...], "speedup": x, "tokens_per_round": [...]}]``.

    The levels are tuned jointly: each combination is one replay of the whole stack, so a bottom rule is
    judged by what it costs and earns under the rule above it.
    """
    rows = []
    for combo in level_combos(grids):
        rep = replay_levels(records, combo, cost)
        rows.append({"policies": combo, "speedup": rep.speedup, "tokens_per_round": rep.tokens_per_round})
    rows.sort(key=lambda r: -r["speedup"])
    return rows
