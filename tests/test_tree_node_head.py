"""The tree node head: its training rows against brute force, training through Lightning, and the
tree decoder steered by it (still the target's output, greedy and sampled)."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import test_tree_decoder as tree_tests
import torch
from _export_fixtures import single_thread  # noqa: F401

from specstop.decode import TreeDecoder, parse_tree_policy
from specstop.decode.drafting import grow_tree
from specstop.decode.node_head import NodeHeadScorer, load_node_head
from specstop.errors import UserError
from specstop.models import build_predictor
from specstop.models.checkpoint import save_predictor_checkpoint
from specstop.models.tree_node import NODE_LABEL
from specstop.testing import write_synthetic_dataset
from specstop.train.tree_nodes import TreeNodeDataModule, node_paths, read_node_columns
from specstop.tree_policy import DynamicTreeShape

# The tree decoder's fixtures: the same tiny pairs, prompts and target references.
prompts, references, small_pair = tree_tests.prompts, tree_tests.references, tree_tests.small_pair  # `pair`: tests/conftest.py
K, DEPTH = 4, 3


@pytest.fixture(scope="module")
def node_data(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("nodes") / "d", {"train": 24, "validation": 6, "test": 2}, 16)


def _brute_force_nodes(cols: dict, k: int, max_depth: int) -> dict:
    """{(prompt, position i, depth d, rank j): (label, log parent joint)} by walking every path."""
    by_prompt: dict = {}
    for r, (pid, i) in enumerate(zip(cols["prompt_id"], cols["position"])):
        by_prompt.setdefault(pid, {})[int(i)] = r
    out = {}
    for pid, rows in by_prompt.items():
        for i, r in rows.items():
            for d in range(1, max_depth + 1):
                path = [rows.get(m) for m in range(i - d + 1, i)]
                if i - d + 1 < 0 or None in path:
                    continue
                ranks = [int(cols["target_rank"][a]) for a in path]
                if any(not 0 <= j < k for j in ranks):
                    continue  # a tree of top-k candidates never holds this path
                lpj = sum(math.log(float(cols["topk"][a][j])) for a, j in zip(path, ranks))
                for j in range(k):
                    out[(pid, i, d, j)] = (float(int(cols["target_rank"][r]) == j), lpj)
    return out


def test_node_rows_match_brute_force(node_data):
    cols = read_node_columns(str(node_data), "train")
    expected = _brute_force_nodes(cols, K, DEPTH)
    assert {lab for lab, _ in expected.values()} == {0.0, 1.0}
    assert any(d == DEPTH for _, _, d, _ in expected)
    dm = TreeNodeDataModule(str(node_data), max_depth=DEPTH, batch_size=64)
    head = build_predictor("tree_node_mlp", k=K)
    dm.configure(head.feature_spec, NODE_LABEL)
    split = dm.load_split("train")
    assert len(split) == len(expected)
    feats = split.features(head.feature_spec)
    spec = head.feature_spec
    for n in range(len(split)):
        p, j = n // K, n % K
        r, d = int(split.row[p]), int(split.depth[p])
        key = (split.prompt_ids[n], int(split.positions[n]), d, j)
        label, lpj = expected[key]
        assert float(split.labels[n]) == label
        assert float(split.log_parent_joint[p]) == pytest.approx(lpj, rel=1e-5, abs=1e-5)
        want = spec.build(torch.tensor([j]), torch.tensor([lpj]), torch.tensor(cols["topk"][r : r + 1]),
                          torch.tensor([float(cols["entropy"][r])]), torch.tensor([d]))[0]
        torch.testing.assert_close(feats[n], want, rtol=1e-5, atol=1e-5)
    # Row order of the stored table does not matter.
    perm = np.random.default_rng(0).permutation(len(cols["position"]))
    shuffled = node_paths(cols["prompt_id"][perm], cols["position"][perm], cols["topk"][perm],
                          cols["target_rank"][perm], k=K, max_depth=DEPTH)
    got = sorted(zip(perm[shuffled.row].tolist(), shuffled.depth.tolist()))
    assert got == sorted(zip(split.row.tolist(), split.depth.tolist()))


def test_old_dataset_needs_regenerating(tmp_path, monkeypatch):
    from specstop.data_gen import schema, storage

    real = schema.features_for

    def before_version_4(table, k, hidden_size):
        f = real(table, k, hidden_size)
        if table == "tokens":
            f = f.copy()
            del f["topk_ids"], f["target_rank"]
        return f

    monkeypatch.setattr(storage, "features_for", before_version_4)
    d = write_synthetic_dataset(tmp_path / "old", {"train": 2, "validation": 1, "test": 1}, 8)
    monkeypatch.undo()
    dm = TreeNodeDataModule(str(d))
    dm.configure(build_predictor("tree_node_mlp").feature_spec, NODE_LABEL)
    with pytest.raises(UserError, match=r"^\S+ has no target_rank / topk_ids columns \(labels version < 4\).*regenerate"):
        dm.load_split("train")
    with pytest.raises(UserError, match="tree node head"):
        dm.configure(build_predictor("disco_ffn").feature_spec, "greedy_match")


def test_training_smoke_through_lightning(node_data, tmp_path):
    import lightning as L

    from specstop.train.module import PredictorModule

    dm = TreeNodeDataModule(str(node_data), max_depth=DEPTH, batch_size=256)
    model = PredictorModule("tree_node_mlp", {"width": 16}, k=dm.k, lr=1e-2)
    dm.configure(model.predictor.feature_spec, model.label)
    val = dm.load_split("validation")

    def val_loss() -> float:
        with torch.no_grad():
            return float(model.loss(model(val.features(model.predictor.feature_spec)), val.labels))

    before = val_loss()
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, dm)
    after = val_loss()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert all(math.isfinite(v) for v in metrics.values())
    assert after < before and metrics["val_auroc"] > 0.6
    ckpt = save_predictor_checkpoint(tmp_path / "head.ckpt", model.predictor, {"dataset": dm.summary()})
    head = load_node_head(ckpt)
    est = head(torch.softmax(torch.randn(50), -1), 3, -0.5, 2)
    assert len(est) == 3 and all(0 < p < 1 for p in est)


def _random_head(k: int, seed: int = 0) -> NodeHeadScorer:
    torch.manual_seed(seed)
    return NodeHeadScorer(build_predictor("tree_node_mlp", k=k, width=8))


def test_head_decides_which_nodes_are_drafted():
    """A scorer that trusts only first candidates grows a deep chain where joint probability spreads wide."""
    q = torch.softmax(torch.randn(40, generator=torch.Generator().manual_seed(1)) * 0.3, -1)

    def expand(tree, nodes):
        return q.expand(len(nodes), -1)

    def first_only(q_v, n, log_joint, depth):
        return [0.99] + [0.01] * (n - 1)

    first_only.max_candidates = 4
    shape = DynamicTreeShape(8, 2, 8)
    plain, _ = grow_tree(shape, 0, q, expand, depth_cap=8, eos=set(), greedy=True)
    steered, _ = grow_tree(shape, 0, q, expand, depth_cap=8, eos=set(), greedy=True, scorer=first_only)
    assert plain.num_drafted == steered.num_drafted == 8
    assert max(steered.depths) > max(plain.depths)
    order = q.topk(4).indices.tolist()
    for kids in steered.children:  # children stay a prefix of the candidate order
        assert [steered.tokens[c] for c in kids] == order[: len(kids)]


@pytest.mark.parametrize("spec", ["tree:16", "tree:6,2,3", "tree:1"])
def test_greedy_tree_with_node_head_equals_target(spec, pair, prompts, references, monkeypatch):
    monkeypatch.setattr(tree_tests, "TreeDecoder", functools.partial(TreeDecoder, node_head=_random_head(10)))
    tree_tests.test_greedy_tree_equals_target(spec, pair, prompts, references)


def test_sampled_tree_with_node_head_follows_the_target(small_pair, monkeypatch):
    monkeypatch.setattr(tree_tests, "TreeDecoder", functools.partial(TreeDecoder, node_head=_random_head(3)))
    tree_tests.test_sampled_tree_follows_the_target("tree:6,3", small_pair)


def test_node_head_refused_where_it_cannot_steer(pair, tmp_path):
    with pytest.raises(UserError, match="a node head steers dynamic trees"):
        TreeDecoder(pair, parse_tree_policy("mcsd:2,2"), node_head=_random_head(4))
    disco = save_predictor_checkpoint(tmp_path / "disco.ckpt", build_predictor("disco_ffn"))
    with pytest.raises(UserError, match="not a tree node head"):
        load_node_head(disco)


def test_decode_cli_node_head(tiny_pair_dir, tmp_path, capsys):
    from specstop.cli import main

    ckpt = save_predictor_checkpoint(tmp_path / "head.ckpt", build_predictor("tree_node_mlp", k=4, width=8))
    base = ["decode", "--pair", str(tiny_pair_dir), "--prompt", "hi", "--max-new-tokens", "8", "--dtype", "float32",
            "--device", "cpu"]
    assert main(base + ["--policy", "tree:8", "--node-head", str(ckpt), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert obj["counters"]["policy"] == "tree:8,2,8+node-head" and obj["counters"]["N"] == len(obj["token_ids"]) <= 8
    plain = main(base + ["--policy", "tree:8", "--json"])
    assert plain == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == obj["token_ids"]
    assert main(base + ["--policy", "mcsd:2,2", "--node-head", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--node-head steers dynamic trees" in err[0]
