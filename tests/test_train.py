"""Loss, metrics, data module, training on a planted signal, checkpoints, online mixing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from specstop.train.loss import weighted_bce_with_logits
from specstop.train.metrics import (
    binary_kl_from_logits,
    cumprod_calibration,
    evaluate_logits,
    static_sl_f1,
    static_sl_predictions,
)

L = pytest.importorskip("lightning")


def quiet_trainer(**kw):
    kw.setdefault("logger", False)
    return L.Trainer(enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1, **kw)


# ---- loss ----------------------------------------------------------------------------------------


def test_weighted_bce_matches_hand_computation():
    z = torch.tensor([2.0, -1.0, 0.5, 30.0])
    y = torch.tensor([1.0, 0.0, 0.3, 0.0])  # hard and soft targets, one saturated logit
    w_acc, w_rej = 1.0, 6.0
    # log sigmoid(z) = -log(1 + e^-z); log(1 - sigmoid(z)) = -log(1 + e^z)  (exact for z = 30 too)
    hand = [
        -w_acc * yi * -math.log1p(math.exp(-zi)) - w_rej * (1 - yi) * -math.log1p(math.exp(zi))
        for yi, zi in zip(y.tolist(), z.tolist())
    ]
    assert weighted_bce_with_logits(z, y, w_acc, w_rej).item() == pytest.approx(sum(hand) / 4, rel=1e-5)
    mask = torch.tensor([True, False, True, False])
    assert weighted_bce_with_logits(z, y, w_acc, w_rej, mask).item() == pytest.approx((hand[0] + hand[2]) / 2, rel=1e-5)
    assert weighted_bce_with_logits(z, y.bool().float(), 1, 1).item() == pytest.approx(
        torch.nn.functional.binary_cross_entropy_with_logits(z, y.bool().float()).item(), rel=1e-6
    )
    assert weighted_bce_with_logits(z, y, mask=torch.zeros(4, dtype=torch.bool)).item() == 0.0


# ---- metrics -------------------------------------------------------------------------------------


def test_binary_kl_and_metrics():
    y, p = 0.7, 0.4
    z = torch.tensor([math.log(p / (1 - p))])
    hand = y * math.log(y / p) + (1 - y) * math.log((1 - y) / (1 - p))
    assert binary_kl_from_logits(z, torch.tensor([y])).item() == pytest.approx(hand, rel=1e-6)  # float32 inputs
    assert binary_kl_from_logits(torch.tensor([3.0]), torch.tensor([1.0])).item() == pytest.approx(
        math.log1p(math.exp(-3.0)), rel=1e-6
    )
    logits = torch.tensor([3.0, 2.0, -2.0, -3.0])
    m = evaluate_logits(logits, torch.tensor([1.0, 0.9, 0.2, 0.0]), threshold=0.9)
    assert m["auroc"] == 1.0 and m["f1"] == 1.0 and m["f1_tau"] == pytest.approx(2 / 3)  # 0.88 < 0.9
    assert 0 <= m["ece"] < 0.2 and m["kl"] > 0


def test_static_sl_definition():
    # greedy labels of one response: 1 1 0 | 1 1 1 | (stop) 1 | 0 ...
    g = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1], dtype=bool)
    pid, pos = np.zeros(len(g)), np.arange(len(g))
    pred, label = static_sl_predictions(pid, pos, g, k=3)
    # round 1 at 0: drafts 0..2, rejected at 2 -> 0,1,2 accept; round 2 at 3: 3,4,5 accepted, 6 is
    # the bonus position (predicted stop); round 3 at 7: rejected at 7; round 4 at 8.
    assert pred.tolist() == [1, 1, 1, 1, 1, 1, 0, 1, 1]
    assert label.tolist() == g.tolist()
    r = static_sl_f1(pid, pos, g, 3)
    tp = 6  # positions 0, 1, 3, 4, 5, 8
    assert r["precision"] == pytest.approx(tp / 8) and r["recall"] == pytest.approx(tp / 7)


def test_cumprod_calibration_windows():
    pid = np.array(["a"] * 3 + ["b"] * 2)
    pos = np.array([0, 1, 2, 0, 1])
    p_hat = np.array([0.5, 0.5, 0.5, 0.9, 0.9])
    p_true = np.array([1.0, 0.0, 1.0, 1.0, 1.0])
    out = cumprod_calibration(pid, pos, p_hat, p_true, max_len=3)
    assert [r["windows"] for r in out] == [5, 3, 1]
    assert out[1]["mean_pred"] == pytest.approx((0.25 + 0.25 + 0.81) / 3)
    assert out[1]["mean_true"] == pytest.approx(1 / 3)  # only b's window survives
    assert out[2]["mean_true"] == 0.0


# ---- data ----------------------------------------------------------------------------------------


def test_datamodule_tables_batches_and_links(synth_dir):
    from specstop.models import build_predictor
    from specstop.train.data import PredictorDataModule

    dm = PredictorDataModule(str(synth_dir), batch_size=500)
    assert (dm.k, dm.hidden_size) == (10, 16)
    dm.configure(build_predictor("specdecpp_resnet", hidden_size=16, depth=1).feature_spec, "accept_prob")
    dm.setup("fit")
    assert dm.splits["train"].table == "mixed"  # hidden-state heads read token mixing rows
    dm2 = PredictorDataModule(str(synth_dir), batch_size=500)
    dm2.configure(build_predictor("disco_ffn").feature_spec, "greedy_match")
    dm2.setup("fit")
    assert dm2.splits["train"].table == "tokens" and len(dm2.splits["train"]) == 48 * 64
    batches = list(dm2.train_dataloader())
    assert len(batches) == math.ceil(48 * 64 / 500)
    x, y = batches[0]
    assert x.shape == (500, 12) and x.dtype == torch.float32 and set(y.unique().tolist()) <= {0.0, 1.0}
    # one epoch covers every row exactly once
    assert sum(len(b[1]) for b in batches) == 48 * 64
    with pytest.raises(ValueError, match="not a column of the 'mixed' table"):
        dm3 = PredictorDataModule(str(synth_dir), table="mixed")
        dm3.configure(build_predictor("disco_ffn").feature_spec, "greedy_match")
        dm3.setup("fit")


def test_hidden_heads_never_fall_back_to_misaligned_token_rows(tmp_path):
    # The tokens table holds the state after X_i while its labels describe Y_i: a split without
    # mixed rows must be an error for hidden-state heads, not a silent fallback (it used to be).
    import json

    from specstop.errors import UserError
    from specstop.models import build_predictor
    from specstop.testing import write_synthetic_dataset
    from specstop.train.data import PredictorDataModule

    d = write_synthetic_dataset(tmp_path / "d", {"train": 4, "validation": 2}, tokens_per_prompt=16,
                                hidden_size=16, with_mixed=True)
    man = json.loads((d / "manifest.json").read_text())
    assert man["splits"]["validation"]["mixed"] > 0
    spec = build_predictor("specdecpp_resnet", hidden_size=16, depth=1).feature_spec
    d2 = write_synthetic_dataset(tmp_path / "d2", {"train": 4, "validation": 2}, tokens_per_prompt=16,
                                 hidden_size=16, with_mixed=False)
    dm = PredictorDataModule(str(d2), batch_size=64)
    dm.configure(spec, "accept_prob")
    with pytest.raises(UserError, match="no token-mixing rows.*labels.mixing.splits"):
        dm.setup("fit")
    dm = PredictorDataModule(str(d), batch_size=64)
    dm.configure(spec, "greedy_match")  # a tokens-only label for a hidden head: also refused
    with pytest.raises(UserError, match="not in the mixed table"):
        dm.setup("fit")
    explicit = PredictorDataModule(str(d2), batch_size=64, table="tokens")  # asked for: obeyed
    explicit.configure(spec, "accept_prob")
    explicit.setup("fit")
    assert explicit.splits["validation"].table == "tokens"


def test_datamodule_rejects_prompt_in_two_splits(tmp_path):
    from specstop.data_gen.storage import load_table, write_shard
    from specstop.models import build_predictor
    from specstop.testing import write_synthetic_dataset
    from specstop.train.data import PredictorDataModule

    d = write_synthetic_dataset(tmp_path / "d", {"train": 2, "validation": 2, "test": 1}, 8)
    tables = {}
    for t in ("sequences", "tokens", "mixed", "rollouts"):
        cols = load_table(d, t, "train").to_dict()
        cols["split"] = ["test"] * len(cols["split"])
        tables[t] = cols
    write_shard(d, "test-00001", tables, k=10, hidden_size=None)  # a train prompt again, as test
    man = json.loads((d / "manifest.json").read_text())  # a consistent manifest: the leak is the only defect
    for key, table in (("prompts", "sequences"), ("tokens", "tokens"), ("mixed", "mixed"), ("rollouts", "rollouts")):
        man["splits"]["test"][key] += len(tables[table]["split"])
    (d / "manifest.json").write_text(json.dumps(man))
    dm = PredictorDataModule(str(d))
    dm.configure(build_predictor("disco_ffn").feature_spec, "greedy_match")
    with pytest.raises(ValueError, match="is in both the 'train' and 'test' splits"):
        dm.setup("fit")


# ---- training ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, config, label",
    [("disco_ffn", {}, "accept_expected"), ("specdecpp_resnet", {"depth": 1}, "accept_prob")],
)
def test_training_reaches_auroc_on_planted_signal(synth_dir, tmp_path, family, config, label):
    from specstop.models.checkpoint import load_predictor
    from specstop.train.data import PredictorDataModule
    from specstop.train.evaluate import predict_logits
    from specstop.train.module import PredictorModule

    L.seed_everything(0)
    dm = PredictorDataModule(str(synth_dir), batch_size=256)
    model = PredictorModule(family, config, label=label, hidden_size=dm.hidden_size, k=dm.k, lr=3e-3)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="val_auroc", mode="max")
    trainer = quiet_trainer(max_epochs=6, callbacks=[ckpt])
    trainer.fit(model, dm)
    assert trainer.callback_metrics["val_auroc"] > 0.9
    # the best checkpoint reloads through load_predictor (torch only) to identical outputs
    predictor, meta = load_predictor(ckpt.best_model_path)
    best = PredictorModule.load_from_checkpoint(ckpt.best_model_path, weights_only=False)
    val = dm.splits["validation"]
    assert torch.equal(predict_logits(predictor, val), predict_logits(best.predictor, val))
    assert meta["label"] == label and meta["family"] == family
    assert meta["dataset"]["tokenizer_hash"] == "synthetic0000000" and meta["dataset"]["temperature"] == 0.0
    assert meta["val_metrics"]["val_auroc"] > 0.5 and meta["feature_spec"]["kind"] in ("dist", "hidden")


def test_schedules_step_halving_and_cosine(synth_dir):
    from specstop.train.data import PredictorDataModule
    from specstop.train.module import PredictorModule

    for schedule, check in (("step_halving", lambda lrs: lrs == [1e-3, 5e-4]), ("cosine", lambda lrs: lrs[1] < lrs[0])):
        dm = PredictorDataModule(str(synth_dir), batch_size=2048, max_rows=2048)
        model = PredictorModule("mcsd_topk_mlp", {}, k=dm.k, lr=1e-3, schedule=schedule)
        lrs = []

        class Rec(L.Callback):
            def __init__(self, out):
                self.out = out

            def on_train_epoch_start(self, trainer, pl_module):
                self.out.append(trainer.optimizers[0].param_groups[0]["lr"])

        quiet_trainer(max_epochs=2, callbacks=[Rec(lrs)], enable_checkpointing=False, limit_val_batches=0).fit(model, dm)
        assert check([round(v, 10) for v in lrs]), (schedule, lrs)


def test_online_mixing_runs_an_epoch(tmp_path, tiny_pair_dir):
    from specstop.models.checkpoint import load_predictor
    from specstop.testing import write_synthetic_dataset
    from specstop.train.online_mixing import OnlineMixingDataModule, OnlineMixingModule

    d = write_synthetic_dataset(tmp_path / "d", {"train": 6, "validation": 2}, 16)  # no hidden dumps
    model = OnlineMixingModule(str(tiny_pair_dir / "draft"), predictor_config={"depth": 1}, lr=1e-3)
    dm = OnlineMixingDataModule(str(d), batch_size=3, mixing_rate=0.15)
    trainer = quiet_trainer(max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(model, dm)
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert model.predictor.config.hidden_size == model.draft.config.hidden_size
    # two epochs draw different mixings; validation keeps one
    from specstop.train.online_mixing import MixedBatches

    ds = MixedBatches(dm.splits["train"], 6, 0.5, 0, True, 0, None)
    a, b = next(iter(ds))["loss_mask"], next(iter(ds))["loss_mask"]
    assert not torch.equal(a, b)
    ckpt = trainer.checkpoint_callback.best_model_path
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert state and not any(k.startswith("draft.") for k in state)  # the frozen draft is not saved
    predictor, meta = load_predictor(ckpt)
    assert meta["online_mixing"]["draft"].endswith("draft")


def test_state_features_are_the_previous_rows_hidden_state(tmp_path):
    # A dist head with_state reads, for token row i, the state that produced q_i: the stored hidden
    # state of row i - 1 of the same response (after X_{i-1}); zeros at position 0.
    from specstop.data_gen.storage import load_arrays
    from specstop.models import build_predictor
    from specstop.testing import write_synthetic_dataset
    from specstop.train.data import PredictorDataModule

    d = write_synthetic_dataset(tmp_path / "d", {"train": 3, "validation": 2}, tokens_per_prompt=10, hidden_size=16)
    pred = build_predictor("disco_ffn", with_state=True, hidden_size=16)
    assert pred.feature_spec.input_dim == 10 + 1 + 1 + 16
    dm = PredictorDataModule(str(d), batch_size=8)
    dm.configure(pred.feature_spec, "greedy_match")
    dm.setup("fit")
    sd = dm.splits["train"]
    x = sd.features(pred.feature_spec, torch.arange(len(sd)))
    raw = load_arrays(d, "tokens", "train", columns=["hidden", "position", "topk"])
    hid = torch.from_numpy(raw["hidden"].astype(np.float32))
    pos = raw["position"]
    assert (pos == sd.positions).all()
    for r in range(len(sd)):
        want = torch.zeros(16) if pos[r] == 0 else hid[r - 1]
        torch.testing.assert_close(x[r, -16:], want)
    torch.testing.assert_close(x[:, :10], torch.from_numpy(raw["topk"][:, :10]).float())
    assert float(pred(x).abs().sum()) > 0
