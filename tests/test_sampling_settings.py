"""Sampling as servers run it (T = 0.7 with top-p 0.9 or with top-k) is lossless in every decoder - chain,
token tree, PEARL, batched - with rules and with learned policies read from exports.

Each case decodes a few hundred seeds and checks the first two tokens against the target's exact
distribution under the same transform, computed by brute force (the target's forward over every
continuation + :func:`specstop.probs.logits_to_probs`, never a decoder): no token outside the target's
kept set, and a pooled chi-square. It also checks that the test means something (drafts are rejected
often, adaptive policies stop and continue) and that every stopping decision read the right inputs:
q_j, the drafted token and the draft's hidden state are those of the row's own sequence, recomputed
by a fresh draft forward (the batched decoder indexes rows and padded block columns; PEARL's windows
start from unverified tokens).

Scaled settings: on a 12-token pair, top-k 4 stands for a server's top-k 50 and top-p 0.9 is the
server's. What makes the check bite is that the transform cuts real probability mass from both
models and keeps different tokens for the draft than for the target (the draft then proposes tokens
the target never emits, and the residual must put mass on tokens the draft never proposes);
:func:`test_settings_cut_the_distributions` asserts both. With 50 of 64 tokens kept the cut tokens would
carry almost no mass and a truncation bug would not show in a few hundred draws.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from _export_fixtures import single_thread, write_checkpoint, write_manifest, write_tuned  # noqa: F401

from specstop import BatchedSpeculativeDecoder, PearlDecoder, SpeculativeDecoder, StoppingPolicy, TreeDecoder
from specstop.decode import PearlSpec, parse_tree_policy
from specstop.decode import tree_decoder as tree_module
from specstop.policy import PolicySpec
from specstop.probs import DecodingConfig, logits_to_probs
from specstop.testing import pooled_chi_square, small_vocab_pair, two_token_distribution

VOCAB = 12
SETTINGS = {"top_p": DecodingConfig(temperature=0.7, top_p=0.9), "top_k": DecodingConfig(temperature=0.7, top_k=4)}
PROMPT = [4, 0]  # where both settings cut most (test_settings_cut_the_distributions)
# The batched decoder's rows: different prompts of different lengths (left padding, per-row blocks).
BATCH = [PROMPT, [1, 3, 2], [5, 7, 1, 2, 9]]
MAX_NEW = 4  # round 1 drafts up to 3 tokens: hidden-state heads decide at j = 2
RUNS = 250  # decodes per case (chain, tree, PEARL: of PROMPT)
BATCH_RUNS = 160  # batched calls, each giving one draw per row of BATCH
CHECK_RUNS, CHECK_NEW = 4, 12  # longer runs whose policy inputs are recomputed by brute force


@pytest.fixture(scope="module")
def pair():
    """The 12-token pair with identities (exports are checked against them)."""
    from specstop.pair.loader import model_identity

    base = small_vocab_pair(vocab=VOCAB, noise=0.15).pair
    return dataclasses.replace(
        base, draft_identity=model_identity(base.draft, "small-draft"),
        target_identity=model_identity(base.target, "small-target"), tokenizer_hash="small-numbers",
    )


@pytest.fixture(scope="module")
def exact(pair):
    """``exact[setting][prompt]``: the target's first-two-token distribution, by brute force."""
    return {name: {tuple(p): two_token_distribution(pair.target, p, dec, VOCAB) for p in BATCH}
            for name, dec in SETTINGS.items()}


# ---------------------------------------------------------------- learned policies (random-init exports)
@torch.no_grad()
def _first_round_states(pair, decoding) -> list[tuple[float, int, torch.Tensor, torch.Tensor]]:
    """``(weight, j, q_j's logits, the hidden state that produced them)`` of PROMPT's first round at j = 1
    and j = 2 (after each y_1 the draft can sample, weighted by its probability)."""
    out = pair.draft(torch.tensor([PROMPT]), output_hidden_states=True)
    states = [(1.0, 1, out.logits[0, -1], out.hidden_states[-1][0, -1])]
    q = logits_to_probs(out.logits[0, -1], decoding, VOCAB)
    for y in q.nonzero().flatten().tolist():
        nxt = pair.draft(torch.tensor([PROMPT + [y]]), output_hidden_states=True)
        states.append((float(q[y]), 2, nxt.logits[0, -1], nxt.hidden_states[-1][0, -1]))
    return states


def _spread_threshold(scores: list[float], states) -> float:
    """The threshold t (stop when score < t; None: no score, continue) that spreads PROMPT's first-round
    draft length K (1, 2 or 3 at MAX_NEW) most evenly - maximal entropy - over the gaps between scores."""
    import math

    values = sorted({x for x in scores if x is not None})
    best, best_h = None, -1.0
    for t in [(a + b) / 2 for a, b in zip(values, values[1:])]:
        stop1 = scores[0] is not None and scores[0] < t
        stop2 = sum(w for (w, j, *_), x in zip(states, scores) if j == 2 and x is not None and x < t)
        dist = [float(stop1), (1 - stop1) * stop2, (1 - stop1) * (1 - stop2)]
        h = -sum(p * math.log(p) for p in dist if p > 0)
        if h > best_h:
            best, best_h = t, h
    assert best_h > 0.3, "the random predictor's scores cannot spread the draft length"
    return best


@pytest.fixture(scope="module")
def exports(tmp_path_factory, pair) -> dict[str, dict[str, str]]:
    """``exports[setting][name]``: random-init disco_ffn (reads q) and specdecpp_resnet (reads hidden states)
    exports for the pair, with thresholds under which PROMPT's first round drafts 1, 2 or 3 tokens depending
    on the draws at that setting (their features read q after the setting's truncation)."""
    return {name: _exports(tmp_path_factory.mktemp(f"sampling-exports-{name}"), pair, decoding)
            for name, decoding in SETTINGS.items()}


def _exports(tmp, pair, decoding) -> dict[str, str]:
    from specstop.export.export import export_from_files

    ds = write_manifest(tmp / "data", pair, temperature=decoding.temperature)
    ck = {"disco": tmp / "disco.ckpt", "sdpp": tmp / "sdpp.ckpt"}
    disco = write_checkpoint(ck["disco"], "disco_ffn", label="accept_expected", seed=1)
    sdpp = write_checkpoint(ck["sdpp"], "specdecpp_resnet", seed=2, hidden_size=pair.draft_identity.hidden_size, depth=2)
    states = _first_round_states(pair, decoding)
    with torch.no_grad():
        probs = logits_to_probs(torch.stack([s[2] for s in states]), decoding, VOCAB)
        pos = torch.tensor([j - 1 for _, j, *_ in states])
        disco_scores = torch.sigmoid(disco(disco.feature_spec.build_from_probs(probs, pos))).tolist()
        # SpecDec++ has no score at j = 1 and at j = 2 scores the state after y_1: stop when 1 - s > h.
        sdpp_scores = [None] + torch.sigmoid(sdpp(torch.stack([s[3] for s in states[1:]]))).tolist()
    specs = {
        "disco": PolicySpec(kind="predictor", family="disco_ffn", threshold=_spread_threshold(disco_scores, states),
                            sl_max=6, reads="dist"),
        "sdpp": PolicySpec(kind="predictor", family="specdecpp_resnet", threshold=1 - _spread_threshold(sdpp_scores, states),
                           sl_max=8, rule="cumprod", reads="hidden"),
    }
    tuned = write_tuned(tmp / "tuned.json", specs, ds, ck, best="disco")
    out = {}
    for name in specs:
        out[name] = str(tmp / f"export_{name}")
        export_from_files(out[name], tuned=tuned, policy=name)
    return out


@pytest.fixture(scope="module")
def node_head(tmp_path_factory, pair):
    """A random-init tree node head, loaded as ``--node-head CKPT`` is."""
    from specstop.decode.node_head import load_node_head
    from specstop.models import build_predictor
    from specstop.models.checkpoint import save_predictor_checkpoint

    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("node-head") / "head.ckpt"
    save_predictor_checkpoint(path, build_predictor("tree_node_mlp", k=4, width=8), {"dataset": {"pair": pair.to_dict()}})
    head = load_node_head(path)
    head.check_pair(pair)
    return head


# ---------------------------------------------------------------- what the policy is asked with
@dataclasses.dataclass
class _Call:
    row: int
    j: int
    position: int
    token: int
    logits: torch.Tensor
    hidden: torch.Tensor | None
    probs: torch.Tensor | None
    stop: bool
    window: list[int] | None = None  # PEARL: the sequence the draft's window was drafted after


@pytest.fixture
def policy_calls(monkeypatch) -> list[_Call]:
    """Every stopping decision of any decoder (PEARL's worker threads included), with its inputs."""
    from specstop.decode.pearl_server import ModelServer

    calls: list[_Call] = []
    one, batch = StoppingPolicy.should_stop, StoppingPolicy.should_stop_batch
    reset, draft = ModelServer.reset, ModelServer.draft
    window: dict[str, list[int] | None] = {"seq": None}

    # PEARL's draft server: follow the tokens its cache holds, so each window's sequence is known.
    def server_reset(self, prefix, *args, **kwargs):
        self.held = list(prefix)
        return reset(self, prefix, *args, **kwargs)

    def server_draft(self, keep, feed, n, position=0):
        window["seq"] = self.held[:keep] + list(feed)
        tokens, rows, seconds = draft(self, keep, feed, n, position)
        self.held = window["seq"] + tokens[:-1]  # every drafted token but the last is fed
        window["seq"] = None
        return tokens, rows, seconds

    def should_stop(self, draft_logits=None, draft_hidden=None, position=0, *, draft_probs=None, draft_token=None):
        stop = one(self, draft_logits, draft_hidden, position, draft_probs=draft_probs, draft_token=draft_token)
        calls.append(_Call(0, self._j, int(position), int(draft_token), draft_logits.clone(),
                           None if draft_hidden is None else draft_hidden.clone(),
                           None if draft_probs is None else draft_probs.clone(), bool(stop), window["seq"]))
        return stop

    def should_stop_batch(self, draft_logits, draft_hidden, positions, *, active=None, draft_probs=None,
                          draft_tokens=None):
        stops = batch(self, draft_logits, draft_hidden, positions, active=active, draft_probs=draft_probs,
                      draft_tokens=draft_tokens)
        for b, act in enumerate(active):
            if act:
                calls.append(_Call(b, self._batch_j[b], int(positions[b]), int(draft_tokens[b]), draft_logits[b].clone(),
                                   None if draft_hidden is None else draft_hidden[b].clone(),
                                   None if draft_probs is None else draft_probs[b].clone(), bool(stops[b])))
        return stops

    monkeypatch.setattr(StoppingPolicy, "should_stop", should_stop)
    monkeypatch.setattr(StoppingPolicy, "should_stop_batch", should_stop_batch)
    monkeypatch.setattr(ModelServer, "reset", server_reset)
    monkeypatch.setattr(ModelServer, "draft", server_draft)
    return calls


@torch.no_grad()
def _check_inputs(pair, decoding, calls: list[_Call], prompts: list[list[int]], outs: list[list[int]]) -> None:
    """Each decision read the row's own draft state: the logits and hidden state of a fresh draft forward
    over the emitted tokens before the round (from ``outs``, the rows' final responses; PEARL: the
    window's sequence, which may hold tokens verified later) plus the round's earlier drafts; q_j is
    their transform and holds y_j."""
    drafted: dict[int, list[int]] = {}
    for c in calls:
        at = f"row {c.row}, j = {c.j}, position {c.position}"
        if c.j == 1:
            drafted[c.row] = []
        assert len(drafted[c.row]) == c.j - 1, f"{at}: the policy missed earlier steps of the round"
        start = c.position - (c.j - 1)  # the round's first response position
        seq = (c.window if c.window is not None else prompts[c.row] + outs[c.row][:start]) + drafted[c.row]
        out = pair.draft(torch.tensor([seq]), output_hidden_states=True)
        close = functools.partial(torch.testing.assert_close, rtol=1e-4, atol=1e-4)
        close(c.logits, out.logits[0, -1], msg=f"{at}: q_j's logits are not the draft's after {seq}")
        if c.hidden is not None:
            close(c.hidden, out.hidden_states[-1][0, -1], msg=f"{at}: the hidden state is not the draft's after {seq}")
        q = logits_to_probs(c.logits, decoding, VOCAB)
        if c.probs is not None:
            close(c.probs, q, msg=f"{at}: q_j is not the transform of its logits")
        assert q[c.token] > 0, f"{at}: drafted token {c.token} is outside q_j's support"
        drafted[c.row].append(c.token)


# ---------------------------------------------------------------- the cases
def _rejections(res) -> int:
    """Verified blocks the target cut short (a residual draw)."""
    return sum(n < k for k, n in zip(res.round_lengths, res.accepted_per_round))


def _decoder(kind: str, policy: str, pair, decoding, exports: dict[str, str], node_head):
    """``(run, close)`` for one case: ``run(seed, max_new)`` decodes and returns ``[(prompt, DecodeResult)]``
    (the batched decoder: one per row of BATCH; the others: PROMPT)."""
    if kind == "batched":
        batched = BatchedSpeculativeDecoder(pair, exports.get(policy, policy), decoding)

        def run_batch(seed: int, max_new: int):
            res = batched.generate(BATCH, max_new, seed=seed)
            return [(prompt, res.row(b)) for b, prompt in enumerate(BATCH)]

        return run_batch, lambda: None
    if kind == "chain":
        dec = SpeculativeDecoder(pair, exports.get(policy, policy), decoding)
    elif kind == "pearl":
        gamma, _, stop = policy.removeprefix("pearl:").partition("+")
        spec = PearlSpec(int(gamma), stop=stop or None) if policy.startswith("pearl:") else PearlSpec(3, stop=exports[policy])
        # The threads backend runs the workers' code (drafting, the policy, the transform) in this
        # process; tests/test_pearl_decoder.py covers the process transport of sampled rows.
        dec = PearlDecoder(pair, spec, decoding, backend="threads").start()
    else:
        head = node_head if policy.endswith("+node-head") else None
        dec = TreeDecoder(pair, parse_tree_policy(policy.removesuffix("+node-head")), decoding, node_head=head)
    return (lambda seed, max_new: [(PROMPT, dec.generate(PROMPT, max_new, seed=seed))]), getattr(dec, "close", lambda: None)


def _count_tree_rejections(monkeypatch) -> list[bool]:
    """Per verified tree: was a candidate rejected (a later sibling accepted, or a residual draw)?"""
    walks: list[bool] = []
    walk = tree_module.sampling_walk

    def counting_walk(tree, target_probs, gen, eos, **kw):
        path, final = walk(tree, target_probs, gen, eos, **kw)
        nodes = [kw.get("start", 0)] + path
        later = any(tree.children[v].index(c) > 0 for v, c in zip(nodes, path))
        walks.append(later or bool(tree.children[nodes[-1]]))  # ended below children: all rejected
        return path, final

    monkeypatch.setattr(tree_module, "sampling_walk", counting_walk)
    return walks


RULES = {"top_p": "confidence:0.5", "top_k": "static:3"}
CASES = (
    [("chain", s, RULES[s]) for s in SETTINGS] + [("chain", s, e) for s in SETTINGS for e in ("disco", "sdpp")]
    + [("batched", s, RULES[s]) for s in SETTINGS] + [("batched", s, e) for s in SETTINGS for e in ("disco", "sdpp")]
    + [("pearl", "top_p", "pearl:2+confidence:0.5"), ("pearl", "top_k", "pearl:1")]
    + [("pearl", s, e) for s in SETTINGS for e in ("disco", "sdpp")]
    + [("tree", s, "mcsd:3,2") for s in SETTINGS] + [("tree", s, "tree:6,3+node-head") for s in SETTINGS]
)
ADAPTIVE = ("confidence", "disco", "sdpp")  # policies whose decisions depend on the draft


@pytest.mark.parametrize("decoder, setting, policy", CASES, ids=["-".join(c) for c in CASES])
def test_sampling_follows_the_target(decoder, setting, policy, pair, exact, exports, node_head, policy_calls,
                                     monkeypatch):
    decoding = SETTINGS[setting]
    label = f"{decoder} {policy} at T={decoding.temperature} top_k={decoding.top_k} top_p={decoding.top_p}"
    tree_walks = _count_tree_rejections(monkeypatch) if decoder == "tree" else []
    run, close = _decoder(decoder, policy, pair, decoding, exports[setting], node_head)
    try:
        counts: dict[tuple, dict] = {}
        draws = rejections = 0
        for seed in range(BATCH_RUNS if decoder == "batched" else RUNS):
            for prompt, res in run(seed, MAX_NEW):
                cells = counts.setdefault(tuple(prompt), {})
                cells[tuple(res.token_ids[:2])] = cells.get(tuple(res.token_ids[:2]), 0) + 1
                rejections += _rejections(res)
                draws += 1
        if decoder == "tree":
            rejections = sum(tree_walks)
        decisions = list(policy_calls)
        # The policy's inputs, on longer runs: blocks of several pending tokens, rows at different lengths.
        for seed in range(CHECK_RUNS if decisions else 0):
            del policy_calls[:]
            rows = run(seed, CHECK_NEW)
            _check_inputs(pair, decoding, policy_calls, [p for p, _ in rows], [res.token_ids for _, res in rows])
    finally:
        close()

    assert rejections > draws * 0.2, f"{label}: the draft must be rejected often for the test to mean anything"
    if any(policy.endswith(a) or policy == a for a in ADAPTIVE):
        # Decisions the policy made (PEARL asks only before a window's budget is used; the chain and
        # batched decoders also ask at the round's cap, K_cap = MAX_NEW - start - 1 here).
        made = {c.stop for c in decisions if decoder == "pearl" or c.j < MAX_NEW - (c.position - c.j + 1) - 1}
        assert made == {True, False}, f"{label}: the policy must both stop and continue (got {made})"
    runs = draws // len(counts)
    for prompt, cells in counts.items():
        ref = exact[setting][prompt]
        outside = sorted(cell for cell, n in cells.items() if n and ref[cell] == 0)
        assert not outside, f"{label}, prompt {list(prompt)}: tokens the target's transform excludes: {outside}"
        stat, df, pvalue = pooled_chi_square(cells, ref, runs)
        assert pvalue > 1e-3, (f"{label}, prompt {list(prompt)}: chi-square {stat:.1f} on {df} df (p={pvalue:.2g}): "
                               "not the target's distribution")


def test_settings_cut_the_distributions(pair):
    """The scaled settings bite where the chi-square looks, the first two tokens: the transform removes
    real mass from the target's distribution, the draft puts mass on pairs the target excludes (they must
    be rejected) and the target on pairs the draft excludes (the residual must reach them). This holds by
    5% or more after PROMPT (the chain, tree and PEARL decoders' prompt) and after another batch row."""
    plain = DecodingConfig(temperature=0.7)
    for name, decoding in SETTINGS.items():
        strong = []
        for prompt in BATCH:
            p = two_token_distribution(pair.target, prompt, decoding, VOCAB)
            q = two_token_distribution(pair.draft, prompt, decoding, VOCAB)
            full = two_token_distribution(pair.target, prompt, plain, VOCAB)
            removed = sum(full[c] for c in p if p[c] == 0)
            draft_only = sum(q[c] for c in p if p[c] == 0)
            target_only = sum(p[c] for c in p if q[c] == 0)
            if min(removed, draft_only, target_only) >= 0.05:
                strong.append(prompt)
        assert PROMPT in strong and len(strong) >= 2, f"{name}: the transform cuts too little (strong rows: {strong})"
