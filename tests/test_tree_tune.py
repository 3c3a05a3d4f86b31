"""Token-tree costs (calibrate-cost's ``tree`` section), tree-shape replay against the tree decoder,
tuning the shape against the cost table, and tree policies through export and decode."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from _data_gen_helpers import make_render, records, replay_data_config
from _export_fixtures import hub_snapshot, single_thread  # noqa: F401

from specstop.decode import TreeDecoder, parse_tree_policy
from specstop.errors import UserError
from specstop.eval.cost import CostModel
from specstop.eval.tree_tune import (
    TreeReplayData,
    load_tree_replay,
    replay_tree,
    static_round_depth,
    tree_candidates,
    tune_tree,
)
from specstop.probs import DecodingConfig
from specstop.testing import tiny_pair

MAX_NEW = 24
STATIC_SHAPES = ["mcsd:1,1,1", "mcsd:2,1", "mcsd:3,2,1", "mcsd:4,2,2,1", "mcsd:2,2,2,2,2"]


def _tree_cost(target: dict, draft: dict, *, t0: float = 0.1) -> CostModel:
    return CostModel(t_draft=draft[1], t_target=t0, target_by_k={0: t0, 1: t0 * 1.1, 8: t0 * 1.5}, provenance="measured",
                     tree={"n_grid": sorted(target), "t_target_tree": target, "w_grid": sorted(draft),
                           "t_draft_width": draft})


FLAT = _tree_cost({1: 0.1, 8: 0.1, 32: 0.105, 64: 0.11}, {1: 0.01, 16: 0.011})     # wide trees nearly free
STEEP = _tree_cost({1: 0.1, 8: 0.4, 32: 1.6, 64: 3.2}, {1: 0.01, 16: 0.16})         # every node costs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from specstop.data_gen.runner import generate_dataset
    from specstop.data_gen.storage import load_table

    torch.set_num_threads(1)
    pair = tiny_pair(seed=3)
    out = tmp_path_factory.mktemp("tree_tune") / "data"
    cfg = replay_data_config(max_new_tokens=MAX_NEW, batch_size=3, rollout_length=4, prompts_per_shard=3)
    cfg.labels.hidden_states = False
    cfg.labels.rollouts.splits = ["validation"]  # `specstop tune` replays chains past mismatches
    generate_dataset(pair, records(6, splits=("validation",)), cfg, out, render=make_render(pair.tokenizer),
                     progress=False)
    seqs = load_table(out, "sequences", "validation")
    prompt_ids = [list(r["prompt_ids"]) for r in seqs]
    return pair, out, prompt_ids


# ---------------------------------------------------------------- replay
def test_static_round_depth_by_hand():
    ranks = np.array([0, 1, 0, 2, -1, 0])
    assert static_round_depth(ranks, 0, (1, 1, 1), 3) == 1      # rank 1 at depth 2 is outside width 1
    assert static_round_depth(ranks, 0, (2, 2, 2), 3) == 3
    assert static_round_depth(ranks, 0, (2, 2, 2), 2) == 2      # the depth cap
    assert static_round_depth(ranks, 3, (3, 3, 3), 3) == 1      # -1: not among the stored candidates
    assert static_round_depth(ranks, 5, (1, 1, 1), 3) == 1      # the response ends


def test_replay_by_hand():
    """Rounds, nodes and price of mcsd:2,1 over one 6-token response, computed by hand."""
    ranks = np.array([0, 0, 1, 0, 0, 0])
    data = TreeReplayData([ranks], [np.full((6, 2), 0.5)], [False], 6, 2, np.full(2, 0.5))
    trace: list = []
    m = replay_tree(data, parse_tree_policy("mcsd:2,1"), FLAT, trace=trace)
    # Round 1 at i=0: X0 (rank 0 < 2), X1 (rank 0 < 1) accepted + 1 -> i=3. Round 2 at i=3: depth cap
    # min(2, 6-3-1)=2: X3, X4 accepted + X5 -> done. Both rounds 2 + 2 = 4 nodes.
    assert trace[0]["accepted"] == [2, 2] and trace[0]["nodes"] == [4, 4]
    # Draft forwards: catch-up (1 token), level 1 (2 nodes); then catch-up of the unfed leaf + final (2).
    assert trace[0]["draft_widths"] == [1, 2, 2, 2]
    seconds = 2 * FLAT.tree_target_cost(4) + FLAT.tree_draft_cost(1) + 3 * FLAT.tree_draft_cost(2)
    assert m["latency_per_token"] == pytest.approx(seconds / 6)
    assert m["speedup"] == pytest.approx(0.1 / (seconds / 6)) and m["exact"] and m["rounds"] == 2


@pytest.mark.parametrize("spec", STATIC_SHAPES)
def test_static_replay_equals_the_tree_decoder(setup, spec):
    """Round for round: the replay's accepted depths are the decoder's; its node counts bound them."""
    pair, out, prompt_ids = setup
    data = load_tree_replay(out, "validation")
    trace: list = []
    replay_tree(data, parse_tree_policy(spec), FLAT, trace=trace)
    dec = TreeDecoder(pair, parse_tree_policy(spec), DecodingConfig(temperature=0.0))
    for ids, rec, ranks in zip(prompt_ids, trace, data.ranks):
        res = dec.generate(ids, max_new_tokens=MAX_NEW)
        assert len(res.token_ids) == len(ranks)
        assert list(res.accepted_per_round) == rec["accepted"], spec
        assert all(k <= n for k, n in zip(res.round_lengths, rec["nodes"]))
        if all(k == n for k, n in zip(res.round_lengths, rec["nodes"])):  # no EOS node cut the tree short
            hist = res.counters["draft_width_hist"]
            assert hist == [rec["draft_widths"].count(w) for w in range(len(hist))]


def test_dynamic_replay_is_marked_approximate(setup):
    _, out, _ = setup
    data = load_tree_replay(out, "validation")
    m = replay_tree(data, parse_tree_policy("tree:8"), FLAT)
    assert not m["exact"] and "approximate" in m["method"]
    assert 0 < m["nodes_per_round"] <= 8 and m["tokens_per_round"] >= 1


def test_candidates_respect_the_stored_k():
    shapes = tree_candidates(3)
    static = [s for s in shapes if hasattr(s, "branching")]
    assert all(max(s.branching) <= 3 and s.max_nodes <= 64 for s in static)
    assert all(list(s.branching) == sorted(s.branching, reverse=True) for s in static)
    assert any(s.label.startswith("tree:") for s in shapes)


# ---------------------------------------------------------------- tuning
def test_tune_follows_the_cost_table(setup):
    _, out, _ = setup
    flat, steep = tune_tree(out, "validation", FLAT), tune_tree(out, "validation", STEEP)
    assert flat["spec"]["kind"] == "tree" and parse_tree_policy(flat["spec"]["policy"]) is not None
    nodes = {name: e["validation"]["nodes_per_round"] for name, e in (("flat", flat), ("steep", steep))}
    assert nodes["flat"] > nodes["steep"]
    v = flat["validation"]
    assert v["speedup"] == max(c["speedup"] for c in v["candidates"])
    with pytest.raises(UserError, match="no measured 'tree' section"):
        tune_tree(out, "validation", CostModel(t_draft=0.01, t_target=0.1))


def test_specstop_tune_writes_the_tree_policy(setup, tmp_path):
    from specstop.eval.tune_cli import tune_dataset

    _, out, _ = setup
    tuned = tune_dataset(out, "validation", {}, FLAT, sl_max_grid=(4,), heuristic_starts=(2,))
    entry = tuned["tree_policies"]["tree_opt"]
    assert entry["spec"]["kind"] == "tree" and entry["validation"]["speedup"] > 0
    assert "tree_opt" not in tuned["policies"]  # chain policies only: eval replays those
    plain = tune_dataset(out, "validation", {}, CostModel(t_draft=0.01, t_target=0.1), sl_max_grid=(4,),
                         heuristic_starts=(2,))
    assert plain["tree_policies"] == {}
    json.dumps(tuned)  # the tuned file is JSON


# ---------------------------------------------------------------- costs
def test_cost_model_tree_section_round_trips_and_interpolates(tmp_path):
    from specstop.eval.cost import load_cost_model

    FLAT.save(tmp_path / "cost.json")
    back = load_cost_model(tmp_path / "cost.json")
    assert back.tree_target_cost(4.5) == pytest.approx(FLAT.tree_target_cost(4.5))
    assert back.tree_target_cost(20) == pytest.approx(0.1 + 0.005 * 12 / 24)
    assert back.tree_draft_cost(8.5) == pytest.approx(0.01 + 0.001 * 7.5 / 15)
    plain = CostModel(t_draft=0.01, t_target=0.1, target_by_k={0: 0.1, 8: 0.3})
    assert plain.tree_target_cost(8) == plain.target_cost(8) and plain.tree_draft_cost(4) == 0.01


def test_tree_rounds_priced_from_the_tree_table():
    from specstop.measure.online import tree_round_seconds

    # Rounds of 8 and 3 nodes and one target-only step; draft forwards: 2 of width 1, 3 of width 2, 1 of width 4.
    expected = FLAT.tree_target_cost(8) + FLAT.tree_target_cost(3) + FLAT.target_cost(0)
    expected += 2 * FLAT.tree_draft_cost(1) + 3 * FLAT.tree_draft_cost(2) + FLAT.tree_draft_cost(4)
    assert tree_round_seconds(FLAT, [8, 3, 0], 4, [0, 2, 3, 0, 1]) == pytest.approx(expected)
    # Without the widths every draft forward is a one-node frontier.
    no_widths = expected - 3 * FLAT.tree_draft_cost(2) - FLAT.tree_draft_cost(4) + 4 * FLAT.tree_draft_cost(1)
    assert tree_round_seconds(FLAT, [8, 3, 0], 4) == pytest.approx(no_widths)


def test_calibrate_times_tree_costs():
    from specstop.measure.calibrate import build_context, calibrate, time_tree

    pair = tiny_pair(seed=0)
    ctx = build_context(pair.tokenizer, ["def f(x):\n    return x\n", "hello world"], 40)
    tree = time_tree(pair, ctx, context_tokens=40, budget_s=0.05, n_grid=(1, 4), w_grid=(1, 2), progress=False)
    assert tree["n_grid"] == [1, 4] and set(tree["t_target_tree"]) == {1, 4} and set(tree["t_draft_width"]) == {1, 2}
    assert all(v > 0 for v in list(tree["t_target_tree"].values()) + list(tree["t_draft_width"].values()))
    cost, _ = calibrate(pair, context=ctx, context_tokens=40, budget_s=0.1, k_grid=(0, 1, 4), progress=False,
                        check_decoder=False, measure_tree=True)
    assert cost.tree and cost.tree_target_cost(3) > 0
    assert json.loads(json.dumps(cost.to_dict()))["tree"]["t_draft_width"]
    cost, _ = calibrate(pair, context=ctx, context_tokens=40, budget_s=0.1, k_grid=(0, 1, 4), progress=False,
                        check_decoder=False)
    assert cost.tree is None


def test_calibrate_cli_has_no_tree_flag():
    from specstop.measure.calibrate_cli import command

    assert command().parse(["--no-tree"])[0].no_tree and not command().parse([])[0].no_tree
    settings, _ = command().parse(["--checkpoint", "a=x.ckpt", "--checkpoint", "y.ckpt"])
    assert settings.checkpoint == ["a=x.ckpt", "y.ckpt"]


# ---------------------------------------------------------------- export and decode
def _target_greedy(pair, ids: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (full forwards, no cache)."""
    from specstop.decode.chain import eos_token_ids

    eos, seq, out = eos_token_ids(pair), list(ids), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(pair.target(input_ids=torch.tensor([seq])).logits[0, -1, : pair.vocab_size].argmax())
            seq.append(tok)
            out.append(tok)
            if tok in eos:
                break
    return out


def _tuned_file(path, tree_policy: str):
    from specstop.policy import PolicySpec

    doc = {"schema_version": 1, "best": "static_opt", "cost_model": FLAT.to_dict(),
           "policies": {"static_opt": {"spec": PolicySpec(kind="static", k=3).to_dict(), "validation": {"speedup": 1.2}}},
           "tree_policies": {"tree_opt": {"spec": {"kind": "tree", "policy": tree_policy},
                                          "validation": {"speedup": 1.5, "exact": True}}}}
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("tree_policy, with_head", [("mcsd:3,2,1", False), ("tree:8,3,4", True)])
def test_exported_tree_policy_decodes_like_the_target(tiny_pair_dir, tmp_path, capsys, tree_policy, with_head):
    from specstop.cli import main
    from specstop.models import build_predictor
    from specstop.models.checkpoint import save_predictor_checkpoint
    from specstop.pair import load_named_pair

    tuned = _tuned_file(tmp_path / "tuned.json", tree_policy)
    out = tmp_path / "export"
    cmd = ["export", "--tuned", str(tuned), "--policy", "tree_opt", "--out", str(out), "--allow-missing-pair"]
    if with_head:
        torch.manual_seed(0)
        head = save_predictor_checkpoint(tmp_path / "head.ckpt", build_predictor("tree_node_mlp", k=4, width=8))
        cmd += ["--node-head", str(head)]
    assert main(cmd) == 0
    assert "token tree" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["tree"]["policy"] == tree_policy and config["policy"]["kind"] == "static"
    assert (out / "node_head.safetensors").is_file() == with_head
    base = ["decode", "--pair", str(tiny_pair_dir), "--prompt", "hi there", "--max-new-tokens", "12", "--dtype",
            "float32", "--device", "cpu", "--json"]
    assert main(base + ["--policy", str(out)]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    label = parse_tree_policy(tree_policy).label
    assert obj["counters"]["policy"] == label + ("+node-head" if with_head else "")
    pair = load_named_pair(str(tiny_pair_dir), dtype="float32", device="cpu")
    assert obj["token_ids"] == _target_greedy(pair, obj["prompt_ids"], 12)


def test_a_tree_export_pushed_and_pulled_by_hub_id_decodes_as_the_same_tree(tiny_pair_dir, tmp_path, capsys,
                                                                              hub_cache, monkeypatch):
    """push_to_hub uploads the node head, a hub download fetches it, and decode --policy OWNER/NAME runs the
    tree decoder with it (huggingface_hub's own cache layout, offline)."""
    from huggingface_hub import hub_mixin

    from specstop.cli import main
    from specstop.export.hub import EXPORT_PATTERNS
    from specstop.export.runtime import StoppingPolicy
    from specstop.models import build_predictor
    from specstop.models.checkpoint import save_predictor_checkpoint

    torch.manual_seed(0)
    head = save_predictor_checkpoint(tmp_path / "head.ckpt", build_predictor("tree_node_mlp", k=4, width=8))
    out = tmp_path / "export"
    assert main(["export", "--tuned", str(_tuned_file(tmp_path / "tuned.json", "tree:8,3,4")), "--policy", "tree_opt",
                 "--out", str(out), "--allow-missing-pair", "--node-head", str(head)]) == 0
    uploaded = tmp_path / "uploaded"

    class FakeApi:  # what push_to_hub hands the Hub: the folder it wrote
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return type("Url", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kwargs):
            shutil.copytree(folder_path, uploaded)
            return f"https://hub.invalid/{repo_id}/commit/1"

    monkeypatch.setattr(hub_mixin, "HfApi", FakeApi)
    StoppingPolicy.from_pretrained(out).push_to_hub("someone/tree-policy")
    from safetensors.torch import load_file

    pushed, exported = (load_file(str(d / "node_head.safetensors")) for d in (uploaded, out))
    assert pushed.keys() == exported.keys() and all(torch.equal(pushed[k], exported[k]) for k in pushed)
    hub_snapshot(hub_cache, "someone/tree-policy", uploaded)
    assert "node_head.safetensors" in EXPORT_PATTERNS

    base = ["decode", "--pair", str(tiny_pair_dir), "--prompt", "hi there", "--max-new-tokens", "12", "--dtype",
            "float32", "--device", "cpu", "--json"]
    capsys.readouterr()
    runs = {}
    for name, policy in (("local", str(out)), ("hub", "someone/tree-policy")):
        assert main(base + ["--policy", policy]) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["hub"]["counters"]["policy"] == parse_tree_policy("tree:8,3,4").label + "+node-head"
    assert runs["hub"]["token_ids"] == runs["local"]["token_ids"]
    assert runs["hub"]["counters"] == runs["local"]["counters"]


def test_saving_a_tree_policy_whose_node_head_is_not_loaded_is_refused(tmp_path):
    from specstop.export.runtime import StoppingPolicy
    from specstop.policy import PolicySpec

    policy = StoppingPolicy(PolicySpec(kind="static", k=3),
                            config={"tree": {"policy": "tree:8,3,4", "node_head": {"family": "tree_node_mlp"}}})
    with pytest.raises(UserError, match="node head, and none is loaded"):
        policy.save_pretrained(tmp_path / "e")


def test_export_refuses_a_node_head_for_static_trees(tmp_path, capsys):
    from specstop.cli import main
    from specstop.models import build_predictor
    from specstop.models.checkpoint import save_predictor_checkpoint

    tuned = _tuned_file(tmp_path / "tuned.json", "mcsd:2,2")
    head = save_predictor_checkpoint(tmp_path / "head.ckpt", build_predictor("tree_node_mlp", k=4, width=8))
    cmd = ["export", "--tuned", str(tuned), "--policy", "tree_opt", "--out", str(tmp_path / "e"), "--allow-missing-pair",
           "--node-head", str(head)]
    assert main(cmd) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dynamic trees" in err[0]
    cmd = ["export", "--tuned", str(tuned), "--policy", "static_opt", "--out", str(tmp_path / "e"), "--allow-missing-pair",
           "--node-head", str(head)]
    assert main(cmd) == 2 and "not a tuned tree policy" in capsys.readouterr().err


# ---------------------------------------------------------------- target-initialized generation
def test_target_init_needs_its_flag_and_a_static_shape(tiny_pair_dir, capsys):
    from specstop.cli import main

    pair = tiny_pair(seed=0)
    plain = TreeDecoder(pair, parse_tree_policy("mcsd:2,1"))
    assert plain.target_init is None and "target-init" not in plain.label  # off unless asked for
    with pytest.raises(UserError, match="static k-config"):
        TreeDecoder(pair, parse_tree_policy("tree:8"), target_init=2)
    with pytest.raises(UserError, match="T >= 1"):
        TreeDecoder(pair, parse_tree_policy("mcsd:2"), target_init=0)
    base = ["decode", "--pair", str(tiny_pair_dir), "--prompt", "hi", "--max-new-tokens", "6", "--dtype", "float32",
            "--device", "cpu"]
    for policy in ("static:4", "tree:8"):
        assert main(base + ["--policy", policy, "--target-init", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--target-init" in err[0] and "mcsd:" in err[0]
    assert main(base + ["--policy", "mcsd:2,1", "--target-init", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert "NOT lossless" in captured.err
    obj = json.loads(captured.out.strip().splitlines()[-1])
    assert obj["counters"]["policy"] == "mcsd:2,1+target-init:2" and obj["counters"]["lossless"] is False


def _target_init_reference(pair, ids: list[int], n: int, branching: list[int], t_init: int,
                           pick=lambda lengths: max(range(len(lengths)), key=lambda j: (lengths[j], -j))):
    """Improved MCSD's target-initialized generation, greedy, by brute force (full forwards, no cache).

    Every round: the target's top ``t_init`` tokens after the sequence are the candidates; below each,
    the draft's top ``branching[d]`` tokens at depth d make the static tree; the target's greedy
    walk accepts a path below each candidate, and ``pick`` chooses the candidate whose path is emitted
    (the paper: the longest accepted path; ties: the earliest candidate).

    Returns:
        ``(tokens, picks, accepted)``: the output, the picked candidate's index and its accepted path
        length per round.
    """
    from specstop.decode.chain import eos_token_ids

    eos, seq, out, picks, accepted = eos_token_ids(pair), list(ids), [], [], []

    def top(model, prefix: list[int], k: int) -> list[int]:
        logits = model(input_ids=torch.tensor([prefix])).logits[0, -1, : pair.vocab_size]
        return logits.topk(k).indices.tolist()

    with torch.no_grad():
        while len(out) < n:
            below = min(len(branching), n - len(out) - 1)
            cands = top(pair.target, seq, t_init if below > 0 else 1)
            paths = []
            for c in cands:
                path = []  # the target's argmax after seq + [c] + path, while the draft proposed it
                while len(path) < below and ([c] + path)[-1] not in eos:
                    want = top(pair.target, seq + [c] + path, 1)[0]
                    if want not in top(pair.draft, seq + [c] + path, branching[len(path)]):
                        break
                    path.append(want)
                paths.append([c] + path)
            j = 0 if below == 0 else pick([len(p) for p in paths])
            picks.append(j)
            accepted.append(len(paths[j]) - 1)
            seq += paths[j]
            out += paths[j]
            if paths[j][-1] in eos:
                break
    return out, picks, accepted


@pytest.mark.parametrize("spec", ["mcsd:1,1,1", "mcsd:3,2,1"])
@pytest.mark.parametrize("t_init", [2, 3])
def test_target_init_emits_the_candidate_with_the_longest_accepted_path(spec, t_init):
    """Which of the target's T tokens each round emits: the one whose drafted continuation the target
    accepts longest (ties: the earliest), as a brute-force replay of the rule decides."""
    pair = tiny_pair(seed=3)
    branching = list(parse_tree_policy(spec).branching)
    prompts = [[5, 9, 17, 3], [11, 2, 40, 8, 8, 30], [7], [21, 4, 4, 19, 2]]
    not_first = other_output = 0
    for ids in prompts:
        want, picks, accepted = _target_init_reference(pair, ids, 16, branching, t_init)
        got = TreeDecoder(pair, parse_tree_policy(spec), target_init=t_init).generate(ids, 16)
        assert got.token_ids == want, f"prompt {ids}: the rule picks candidates {picks} per round"
        assert got.accepted_per_round == accepted
        not_first += sum(j > 0 for j in picks)
        # The check can tell the rule apart: the target's top token every round is another output.
        other_output += _target_init_reference(pair, ids, 16, branching, t_init, pick=lambda lengths: 0)[0] != want
    assert not_first >= 1 and other_output >= 1


@pytest.mark.parametrize("spec", ["mcsd:2,1", "mcsd:3,2,1"])
def test_target_init_runs_and_one_target_token_is_lossless(spec):
    pair = tiny_pair(seed=3)
    prompts = [[5, 9, 17, 3], [11, 2, 40, 8, 8, 30], [7]]
    changed = 0
    for ids in prompts:
        ref = _target_greedy(pair, ids, 16)
        one = TreeDecoder(pair, parse_tree_policy(spec), target_init=1).generate(ids, 16)
        assert one.token_ids == ref  # T = 1: the target's own token starts every round
        two = TreeDecoder(pair, parse_tree_policy(spec), target_init=2).generate(ids, 16)
        assert 1 <= len(two.token_ids) <= 16 and two.counters["N"] == len(two.token_ids)
        # A round ending at max_new_tokens - 1 emits the target's first token with no forward (K = 0).
        assert two.counters["N_target"] == sum(k > 0 for k in two.round_lengths)
        assert all(n + 1 <= 1 + len(parse_tree_policy(spec).branching) for n in two.accepted_per_round)
        changed += two.token_ids != ref
        # Both caches hold a prefix of the emitted sequence: continuing from them is a fresh forward.
        state = TreeDecoder(pair, parse_tree_policy(spec), target_init=2)
        state.generate(ids, 16)
        seq = state.last_state["seq"]
        for lm, model in ((state.last_state["target"], pair.target), (state.last_state["draft"], pair.draft)):
            assert lm.length == lm.cache.get_seq_length() <= len(seq)
            extra = [] if seq[lm.length :] else seq[-1:]  # nothing pending: feed the last token once more
            with torch.no_grad():
                cont, _ = lm.feed(seq[lm.length :] + extra, keep_logits=1)
                fresh = model(torch.tensor([seq + extra])).logits[0, -1]
            torch.testing.assert_close(cont[-1], fresh, atol=1e-4, rtol=1e-4)
    assert changed >= 1  # T = 2 picks tokens by what follows them: not the target's output
    sampled = TreeDecoder(pair, parse_tree_policy(spec), DecodingConfig(temperature=1.0), target_init=2)
    res = sampled.generate(prompts[0], 12, seed=1)
    assert 1 <= len(res.token_ids) <= 12
