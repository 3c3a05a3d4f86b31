"""Exact greedy replay of speculative decoding under a stopping policy (reference implementation).

Follows docs/design.md "Speculative decoding rounds" step by step through
:class:`specstop.policy.RoundPolicy`, one prompt at a time. It is the ground truth the fast
segment engine (:mod:`specstop.eval.segments`) and the tuner are tested against, and it runs the
stateful heuristic schedule. Semantics:

* a round starting at s has K_cap = min(policy cap, remaining - 1) with remaining =
  max_new_tokens - s; K_cap == 0 is a target-only step;
* draft step j proposes the token at position s + j - 1: the teacher-forced row while all earlier
  proposals matched (X_p if greedy_match[p], else the mismatch token d_p = draft_argmax[p]); after
  a mismatch at m, step j reads rollout step t = s + j - 1 - m of m;
* drafting stops when the policy says stop, at j == K_cap, or when the drafted token is EOS;
* n = leading matches; the round emits n drafted tokens plus one target token, except when an
  accepted draft token is EOS (the response ends there; no token follows EOS).

The oracle drafts exactly the leading matches (K may be 0, a target-only step), capped only by
remaining - 1 (it ignores sl_max: it is the lower bound DISCO and SpecDec++ report).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from specstop.errors import UserError
from specstop.eval.cost import CostModel
from specstop.eval.episodes import ReplayData
from specstop.policy import PolicySpec, RoundPolicy, StepFeatures


class RolloutTooShortError(UserError):
    """A round needs more rollout steps after a mismatch than the dataset stores."""


def rollout_error(prompt: str, m: int, stored: int, needed: int) -> RolloutTooShortError:
    return RolloutTooShortError(
        f"prompt {prompt}: a round drafts past the mismatch at position {m} and needs rollout step {needed}, "
        f"but only {stored} are stored. Regenerate the dataset with a longer --rollout-length "
        f"(labels.rollouts.length >= SL_max - 1) or use a lower SL_max."
    )


def truncated_error(prompt: str, max_new_tokens: int) -> str:
    return (
        f"prompt {prompt}: the response ends before max_new_tokens={max_new_tokens} without EOS, so replay cannot "
        "know the tokens after it. The dataset is inconsistent (wrong generation.max_new_tokens or eos_token_id "
        "in manifest.json); regenerate it."
    )


@dataclass
class Counts:
    """Replay counters (summed over prompts).

    Attributes:
        n: emitted tokens N. rounds: target passes N_target (target-only steps included).
        drafted: N_draft. accepted: accepted draft tokens. discarded: N_discarded = drafted - accepted.
        target_only: rounds that drafted nothing. prompts: number of prompts.
        k_hist: [K_max + 1] number of rounds that drafted K tokens (K = 0: target-only steps); what
            a cost model with a measured t_target(K) table prices (:meth:`CostModel.total_hist`).
        unproposed: draft steps whose token was not proposed (replayed with ``drop_failing``: a round
            that ends *before* the token failing its rule still paid the step that drafted it); priced
            at one drafted token each on top of ``k_hist``.
    """

    n: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_only: int = 0
    prompts: int = 0
    k_hist: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    unproposed: int = 0

    def __post_init__(self) -> None:
        self.k_hist = np.asarray(self.k_hist, dtype=np.int64).reshape(-1)
        if self.rounds and not self.k_hist.sum():
            # Built from totals alone: only "all rounds target-only" is unambiguous.
            if self.rounds == self.target_only and self.drafted == 0:
                self.k_hist = np.array([self.rounds], dtype=np.int64)
            else:
                raise ValueError("Counts with rounds > 0 need k_hist (the histogram of K per round)")

    @property
    def discarded(self) -> int:
        return self.drafted - self.accepted

    def add(self, other: Counts) -> None:
        for f in ("n", "rounds", "drafted", "accepted", "target_only", "prompts", "unproposed"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.k_hist = add_hists(self.k_hist, other.k_hist)

    def add_round(self, k: int, n_acc: int, emitted: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += n_acc
        self.n += emitted
        self.target_only += int(k == 0)
        if k >= len(self.k_hist):
            self.k_hist = np.concatenate([self.k_hist, np.zeros(k + 1 - len(self.k_hist), dtype=np.int64)])
        self.k_hist[k] += 1

    def metrics(self, cost: CostModel | None = None) -> dict:
        """The report's numbers. Mean accepted per round: ``accepted_per_round`` excludes the target's
        bonus/correction token, ``tokens_per_round`` (= N / N_target) includes it."""
        n = max(self.n, 1)
        r = max(self.rounds, 1)
        out = {
            "n": self.n,
            "n_target": self.rounds,
            "n_draft": self.drafted,
            "n_accepted": self.accepted,
            "n_discarded": self.discarded,
            "target_only_steps": self.target_only,
            "prompts": self.prompts,
            "verification_rate": self.rounds / n,
            "discard_rate": self.discarded / n,
            "accepted_per_round": self.accepted / r,
            "tokens_per_round": self.n / r,
        }
        if cost is not None:
            seconds = float(cost.total_hist(self.k_hist)) + self.unproposed * cost.per_drafted
            out["latency_per_token"] = seconds / n
            out["speedup"] = cost.target_only_per_token / out["latency_per_token"]
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        nz = np.flatnonzero(self.k_hist)
        d["k_hist"] = self.k_hist[: (nz[-1] + 1 if len(nz) else 1)].tolist()  # trailing zeros carry nothing
        return d


def add_hists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sum of two K histograms of possibly different lengths."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    if len(a) < len(b):
        a, b = b, a
    out = a.copy()
    out[: len(b)] += b
    return out


@dataclass
class ReplayTrace:
    """Per-round detail (reference replay only): ``k`` drafted and ``n`` accepted per round, [rounds]."""

    k: list = field(default_factory=list)
    n: list = field(default_factory=list)
    start: list = field(default_factory=list)
    prompt: list = field(default_factory=list)


def score_key(spec: PolicySpec) -> str | None:
    """Which score array a predictor policy reads: ``spec.extra['scores']``, else its family."""
    if spec.kind != "predictor":
        return None
    return spec.extra.get("scores") or spec.family


def replay(
    data: ReplayData, spec: PolicySpec, *, trace: ReplayTrace | None = None, prompts=None, make_policy=RoundPolicy,
    drop_failing: bool = False,
) -> Counts:
    """Replay every prompt (or the given prompt indices) step by step; return summed counters.

    ``make_policy(spec)`` builds the per-round state machine: :class:`RoundPolicy` for every shipped
    rule; analyses pass a subclass to replay a rule shape before it becomes a ``PolicySpec`` kind.
    ``drop_failing``: the token at which the rule stops is drafted but not proposed (llama.cpp's
    ``--spec-draft-p-min`` ends a draft *before* a token below it); specstop's decoders propose it.
    """
    total = Counts()
    key = score_key(spec)
    if key is not None and key not in data.row_scores:
        raise KeyError(
            f"no predictor scores {key!r} in the replay data (have: {sorted(data.row_scores)}); score it first"
        )
    for p in range(data.num_prompts) if prompts is None else prompts:
        total.add(replay_prompt(data, int(p), spec, trace=trace, make_policy=make_policy, drop_failing=drop_failing))
    return total


def replay_prompt(
    data: ReplayData, p: int, spec: PolicySpec, *, trace: ReplayTrace | None = None, make_policy=RoundPolicy,
    drop_failing: bool = False,
) -> Counts:
    """Step-by-step replay of prompt ``p`` (see module docstring for the exact rules)."""
    o = int(data.offsets[p])
    n_tok = int(data.offsets[p + 1]) - o
    eos = set(data.eos_token_ids)
    gm, tok, dam = data.greedy_match, data.token, data.draft_argmax
    key = score_key(spec)
    reads = spec.reads if key is None else data.score_reads.get(key, spec.reads)
    row_sc = data.row_scores.get(key) if key else None
    out = Counts(prompts=1)
    policy = make_policy(spec)
    s = 0
    while s < n_tok:
        remaining = data.max_new_tokens - s
        if spec.kind == "oracle":
            cap = remaining - 1
        else:
            cap = min(policy.cap(), remaining - 1)
        if cap <= 0:
            _emit(out, trace, p, s, 0, 0, 1)
            s += 1
            continue
        if spec.kind == "oracle":
            k = 0
            while k < cap and s + k < n_tok and gm[o + s + k]:
                k += 1
                if tok[o + s + k - 1] in eos:
                    break
            eos_acc = k > 0 and tok[o + s + k - 1] in eos
            emitted = k if eos_acc else k + 1
            _emit(out, trace, p, s, k, k, emitted)
            s += emitted
            continue
        policy.reset()
        m = None  # row index of the mismatch, once drafted
        prev_hidden_score = None
        k = 0
        for j in range(1, cap + 1):
            pos = s + j - 1
            if m is None:
                if pos >= n_tok:
                    raise ValueError(truncated_error(str(data.prompt_ids[p]), data.max_new_tokens))
                row = o + pos
                if gm[row]:
                    y, top1 = tok[row], data.top1[row]
                    dist_sc = row_sc[row] if row_sc is not None else None
                    hid_sc = dist_sc
                else:
                    m = row
                    y, top1 = dam[row], data.top1[row]
                    r = int(data.rollout_of_row[row])
                    dist_sc = row_sc[row] if row_sc is not None else None
                    hid_sc = data.mismatch_scores[key][r] if (key and r >= 0) else None
            else:
                t = o + pos - m  # rollout step, 1-based
                r = int(data.rollout_of_row[m])
                stored = 0 if r < 0 else int(data.r_offsets[r + 1] - data.r_offsets[r])
                if t > stored:
                    raise rollout_error(str(data.prompt_ids[p]), m - o, stored, t)
                q = int(data.r_offsets[r]) + t - 1
                y, top1 = data.r_tokens[q], data.r_top1[q]
                dist_sc = data.rollout_scores[key][q] if key else None
                hid_sc = dist_sc
            score = None
            if key is not None:
                score = (
                    float(dist_sc)
                    if reads == "dist"
                    else (None if prev_hidden_score is None else float(prev_hidden_score))
                )
            features = StepFeatures(j=j, position=pos, top1=float(top1), score=score)
            prev_hidden_score = hid_sc
            if drop_failing:
                if policy.rule_fires(features):  # drafted, not proposed: the round ends before token j
                    out.unproposed += 1
                    if m == o + pos:
                        m = None  # the mismatch was the dropped token: every proposed token matches
                    break
                stop = j >= policy.cap()
            else:
                stop = policy.should_stop(features)
            k = j
            if stop or y in eos:
                break
        n_acc = k if m is None else m - (o + s)
        eos_acc = m is None and k > 0 and tok[o + s + k - 1] in eos
        emitted = n_acc if eos_acc else n_acc + 1
        policy.end_round(k, n_acc)
        _emit(out, trace, p, s, k, n_acc, emitted)
        s += emitted
    return out


def _emit(out: Counts, trace: ReplayTrace | None, p: int, s: int, k: int, n_acc: int, emitted: int) -> None:
    out.add_round(k, n_acc, emitted)
    if trace is not None:
        trace.k.append(k)
        trace.n.append(n_acc)
        trace.start.append(s)
        trace.prompt.append(p)


def oracle_lengths(data: ReplayData) -> np.ndarray:
    """The oracle's speculation length of every round, [rounds] (DISCO Table 2 / Fig. 5)."""
    tr = ReplayTrace()
    replay(data, PolicySpec(kind="oracle"), trace=tr)
    return np.asarray(tr.k, dtype=np.int64)
