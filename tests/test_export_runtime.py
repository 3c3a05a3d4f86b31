"""Export round trip, runtime decisions vs the training-time module, refusals, import isolation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _export_fixtures import random_exports, single_thread, write_checkpoint, write_manifest, write_tuned  # noqa: F401

from specstop.export.export import ExportError, export_from_files, export_policy
from specstop.export.runtime import DraftMismatchError, StoppingPolicy
from specstop.models import build_predictor
from specstop.models.checkpoint import load_predictor
from specstop.policy import PolicySpec, RoundPolicy, StepFeatures
from specstop.probs import DecodingConfig, logits_to_probs


def test_runtime_imports_no_lightning_or_datasets():
    code = (
        "import sys, specstop.export.runtime as r; "
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'datasets', 'transformers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_export_round_trip_identical_outputs(exports, pair):
    for name in ("disco", "sdpp"):
        cfg = json.loads((exports[name] / "config.json").read_text())
        assert cfg["schema_version"] == 1 and cfg["export_check"]["max_abs_diff"] <= 1e-6
        assert cfg["pair"]["tokenizer_hash"] == pair.tokenizer_hash
        assert cfg["decoding"]["temperature"] == 0.0 and cfg["cost_model"]["t_draft"] == 0.01
        assert cfg["features"]["kind"] == ("dist" if name == "disco" else "hidden")
        assert (exports[name] / "model.safetensors").is_file() and (exports[name] / "README.md").is_file()
        policy = StoppingPolicy.from_pretrained(exports[name], draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash)
        ref, _ = load_predictor(cfg["source"]["checkpoint"])
        x = torch.randn(32, ref.feature_spec.input_dim)
        with torch.no_grad():
            assert torch.equal(ref(x), policy.predictor(x))
    static = StoppingPolicy.from_pretrained(exports["static"])
    assert static.predictor is None and static.spec.k == 3
    assert not (exports["static"] / "model.safetensors").exists()


def _synthetic_round(family, **config):
    torch.manual_seed(3)
    model = build_predictor(family, **config)
    if family == "specdecpp_resnet":
        spec = PolicySpec(kind="predictor", family=family, threshold=0.6, sl_max=12, rule="cumprod", reads="hidden")
    else:
        spec = PolicySpec(kind="predictor", family=family, threshold=0.5, sl_max=12, reads=model.feature_spec.kind)
    return model, spec


@pytest.mark.parametrize(
    "family,config",
    [("disco_ffn", {}), ("mcsd_topk_mlp", {}), ("specdecpp_resnet", {"hidden_size": 32, "depth": 1}),
     ("mcsd_hidden_mlp", {"hidden_size": 32}), ("disco_ffn", {"with_state": True, "hidden_size": 32})],
)
def test_runtime_decisions_equal_training_module(family, config, tmp_path):
    model, spec = _synthetic_round(family, **config)
    export_policy(tmp_path, spec=spec, predictor=model, allow_missing_pair=True)
    policy = StoppingPolicy.from_pretrained(tmp_path)
    fs = model.feature_spec
    g = torch.Generator().manual_seed(0)
    for _round in range(5):
        ref = RoundPolicy(spec)
        ref.reset()
        policy.reset()
        start = int(torch.randint(0, 300, (1,), generator=g))
        for j in range(1, 13):
            logits = torch.randn(300, generator=g) * 4
            hidden = torch.randn(32, generator=g) * 2
            pos = start + j - 1
            # The training-time module scores what the dataset row holds (design.md alignment rule).
            if fs.reads_hidden:
                with torch.no_grad():
                    score = None if j == 1 else float(torch.sigmoid(model(hidden.unsqueeze(0)))[0])
            else:
                probs = logits_to_probs(logits, DecodingConfig())
                state = hidden.unsqueeze(0) if fs.reads_state else None  # the state that produced q_j
                x = fs.build_from_probs(probs.unsqueeze(0), torch.tensor([pos]), state)
                with torch.no_grad():
                    score = float(torch.sigmoid(model(x))[0])
            want = ref.should_stop(StepFeatures(j=j, position=pos, score=score))
            got = policy.should_stop(logits, hidden, position=pos)
            assert got == want, (family, j)
            if want:
                break


def test_batched_form_matches_single(tmp_path):
    model, spec = _synthetic_round("specdecpp_resnet", hidden_size=32, depth=1)
    export_policy(tmp_path, spec=spec, predictor=model, allow_missing_pair=True)
    single = [StoppingPolicy.from_pretrained(tmp_path) for _ in range(3)]
    batch = StoppingPolicy.from_pretrained(tmp_path)
    batch.reset_batch(batch_size=3)
    for p in single:
        p.reset()
    active = torch.ones(3, dtype=torch.bool)
    g = torch.Generator().manual_seed(1)
    for j in range(1, 10):
        hidden = torch.randn(3, 32, generator=g)
        logits = torch.randn(3, 50, generator=g)
        out = batch.should_stop_batch(logits, hidden if j > 1 else None, [j - 1] * 3, active=active)
        for b in range(3):
            if active[b]:
                assert bool(out[b]) == single[b].should_stop(logits[b], hidden[b] if j > 1 else None, j - 1)
        active &= ~out
    conf = StoppingPolicy.from_string("confidence:0.4")
    conf.reset_batch(batch_size=2)
    probs = torch.tensor([[0.9, 0.1], [0.3, 0.7]]).log()
    assert conf.should_stop_batch(probs, None, [0, 0]).tolist() == [False, False]


def test_refuses_other_draft_tokenizer_and_schema(exports, pair, tmp_path):
    d = exports["disco"]
    with pytest.raises(DraftMismatchError, match="tokenizer hash"):
        StoppingPolicy.from_pretrained(d, tokenizer_hash="0123456789abcdef")
    # Without a weights fingerprint (identities recorded before it existed) the name decides.
    other = dict(pair.draft_identity.to_dict(), name_or_path="Qwen/Other-0.5B", hidden_size=64, weights_sha256=None)
    with pytest.raises(DraftMismatchError, match="Qwen/Other-0.5B"):
        StoppingPolicy.from_pretrained(d, draft_identity=other)
    with pytest.raises(DraftMismatchError, match="allow_draft_mismatch"):
        StoppingPolicy.from_pretrained(d, draft_identity="some/other-draft")
    assert StoppingPolicy.from_pretrained(d, draft_identity="some/other-draft", allow_draft_mismatch=True).predictor is not None
    assert StoppingPolicy.from_pretrained(d, draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash)
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    cfg["schema_version"] = 99
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="schema version 99"):
        StoppingPolicy.from_pretrained(bad)


def test_export_errors_name_the_fix(tmp_path, pair):
    ck = tmp_path / "m.ckpt"
    write_checkpoint(ck, "disco_ffn")
    spec = PolicySpec(kind="predictor", family="disco_ffn", threshold=0.5)
    tuned = write_tuned(tmp_path / "t.json", {"d": spec}, tmp_path / "nodata", {}, best="d")
    with pytest.raises(ExportError, match="--checkpoint"):
        export_from_files(tmp_path / "o", tuned=tuned)
    with pytest.raises(ExportError, match="pass --data DIR"):
        export_from_files(tmp_path / "o", tuned=tuned, checkpoint=ck)
    ds = write_manifest(tmp_path / "data", pair)
    cfg = export_from_files(tmp_path / "o", tuned=tuned, checkpoint=ck, dataset=ds)
    assert cfg["predictor"]["family"] == "disco_ffn"
    wrong = PolicySpec(kind="predictor", family="mcsd_topk_mlp", threshold=0.5)
    tuned2 = write_tuned(tmp_path / "t2.json", {"d": wrong}, ds, {"d": ck}, best="d")
    with pytest.raises(ExportError, match="family"):
        export_from_files(tmp_path / "o2", tuned=tuned2)


def test_cli_export_and_strings(tmp_path, pair, capsys):
    from specstop.cli import main

    ck = tmp_path / "m.ckpt"
    write_checkpoint(ck, "mcsd_topk_mlp")
    ds = write_manifest(tmp_path / "data", pair)
    specs = {"m": PolicySpec(kind="predictor", family="mcsd_topk_mlp", threshold=0.4), "c": PolicySpec(kind="confidence", threshold=0.3)}
    tuned = write_tuned(tmp_path / "t.json", specs, ds, {"m": ck}, best="m")
    assert main(["export", "--tuned", str(tuned), "--out", str(tmp_path / "e")]) == 0
    assert "max abs diff" in capsys.readouterr().out
    assert main(["export", "--tuned", str(tuned), "--policy", "c", "--out", str(tmp_path / "c")]) == 0
    assert StoppingPolicy.load(tmp_path / "c").spec.threshold == 0.3
    assert StoppingPolicy.load("static:4").cap() == 4
    h = StoppingPolicy.from_string("heuristic")
    h.end_round(5, 5)
    assert h.cap() == 7


def test_confidence_reads_the_drafted_tokens_probability_under_sampling():
    # HF's assistant_confidence_threshold reads the probability of the token the draft produced; under
    # sampling that is q_j(y_j), not max q_j (greedy drafts the argmax: the same number).
    probs = torch.tensor([0.9, 0.05, 0.05])
    pol = StoppingPolicy.from_string("confidence:0.3")
    pol.configure(DecodingConfig(temperature=1.0), 3)
    pol.reset()
    assert pol.should_stop(None, None, 0, draft_probs=probs, draft_token=1)  # 0.05 < 0.3: stop
    pol.reset()
    assert not pol.should_stop(None, None, 0, draft_probs=probs, draft_token=0)
    pol.configure(DecodingConfig(), 3)  # greedy: the maximum
    pol.reset()
    assert not pol.should_stop(None, None, 0, draft_probs=probs, draft_token=1)
    batch = StoppingPolicy.from_string("confidence:0.3")
    batch.configure(DecodingConfig(temperature=1.0), 3)
    batch.reset_batch(batch_size=2)
    out = batch.should_stop_batch(None, None, [0, 0], draft_probs=probs.repeat(2, 1), draft_tokens=[1, 0])
    assert out.tolist() == [True, False]
