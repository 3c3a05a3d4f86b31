"""`specstop export --for ENGINE`: the tuned settings each engine accepts, with their prediction."""

from __future__ import annotations

import json
import shlex

import pytest

from specstop.cli import main
from specstop.export.engines import engine_settings, llamacpp_flags
from specstop.policy import PolicySpec

COST = {"t_draft": 0.01, "t_target": 0.03, "verify_per_token": 0.0, "predictor_per_step": 0.0, "kind": "specdecpp"}


def _tuned(tmp_path) -> dict:
    def entry(spec, speedup):
        return {"spec": spec.to_dict(), "validation": {"speedup": speedup, "latency_per_token": 0.03 / speedup,
                                                       "tokens_per_round": 2.5}}

    tuned = {
        "schema_version": 1,
        "policies": {
            "static_opt": entry(PolicySpec(kind="static", k=4), 1.40),
            "heuristic_opt": entry(PolicySpec(kind="heuristic", start=3), 1.35),
            "confidence_opt": entry(PolicySpec(kind="confidence", threshold=0.62, sl_max=12), 1.55),
        },
        "best": "confidence_opt",
        "cost_model": COST,
        "dataset": str(tmp_path / "no-data"),
        "split": "validation",
    }
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    return tuned


def test_each_engine_gets_its_knobs_and_the_prediction(tmp_path):
    tuned = _tuned(tmp_path)
    hf = engine_settings(tuned, "hf", draft="d", target="t")
    assert hf["options"]["static_opt"]["generate_kwargs"] == {
        "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    assert hf["options"]["heuristic_opt"]["generate_kwargs"]["num_assistant_tokens_schedule"] == "heuristic"
    conf = hf["options"]["confidence_opt"]
    assert conf["generate_kwargs"] == {"num_assistant_tokens": 12, "num_assistant_tokens_schedule": "constant",
                                       "assistant_confidence_threshold": 0.62}
    assert hf["recommended"] == "confidence_opt" and conf["predicted"]["speedup"] == 1.55
    assert hf["cost_model"] == COST  # the calibration the prediction assumes

    vllm = engine_settings(tuned, "vllm", draft="d", target="t")
    assert list(vllm["options"]) == ["static_opt"]  # vLLM has a fixed draft length only
    assert vllm["options"]["static_opt"]["speculative_config"] == {"model": "d", "num_speculative_tokens": 4}

    lc = engine_settings(tuned, "llamacpp", draft="d.gguf", target="t.gguf")
    assert lc["recommended"] == "confidence_opt"
    flags = lc["options"]["confidence_opt"]["flags"]
    assert flags == ["--spec-type", "draft-simple", "--spec-draft-n-max", "12", "--spec-draft-n-min", "0",
                     "--spec-draft-p-min", "0.62"]
    assert lc["options"]["static_opt"]["flags_legacy"] == ["--draft-max", "4", "--draft-min", "0", "--draft-p-min", "0"]
    cmd = shlex.split(lc["options"]["confidence_opt"]["command"])
    assert cmd[:5] == ["llama-server", "-m", "t.gguf", "-md", "d.gguf"] and cmd[-8:] == flags
    assert lc["options"]["confidence_opt"]["caveat"]  # p-min drops the low-confidence token, ours keeps it

    sg = engine_settings(tuned, "sglang", draft="d", target="t")
    flags = sg["options"]["static_opt"]["flags"]
    assert flags[flags.index("--speculative-num-steps") + 1] == "4"
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == "5"


def test_llamacpp_static_policy_disables_p_min():
    assert llamacpp_flags(PolicySpec(kind="static", k=6).to_dict()) == [
        "--spec-type", "draft-simple", "--spec-draft-n-max", "6", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]


def test_llamacpp_command_names_the_gguf_a_converted_pair_came_from(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTOP_CACHE", str(tmp_path / "cache"))
    from specstop.paths import downloads_dir

    downloads_dir().mkdir(parents=True)
    (downloads_dir() / "t.gguf").write_bytes(b"GGUF")
    converted, plain = tmp_path / "target", tmp_path / "draft"
    converted.mkdir()
    plain.mkdir()
    (converted / "specstop_source.json").write_text(json.dumps({"gguf_file": "t.gguf"}))
    settings = engine_settings(_tuned(tmp_path), "llamacpp", draft=str(plain), target=str(converted))
    argv = shlex.split(settings["options"]["static_opt"]["command"])
    assert argv[argv.index("-m") + 1] == str(downloads_dir() / "t.gguf")  # llama.cpp reads GGUF only
    assert argv[argv.index("-md") + 1] == str(plain)  # no record: the folder as given


def test_unknown_engine_and_missing_policies_are_clear(tmp_path):
    tuned = _tuned(tmp_path)
    with pytest.raises(ValueError, match="choose from"):
        engine_settings(tuned, "tgi")
    del tuned["policies"]["static_opt"]
    with pytest.raises(ValueError, match="vllm can express"):
        engine_settings(tuned, "vllm")


def test_export_for_engines_cli(tmp_path, capsys):
    _tuned(tmp_path)
    out = tmp_path / "engines"
    rc = main(["export", "--tuned", str(tmp_path / "tuned.json"), "--out", str(out), "--for", "vllm,llamacpp,sglang",
               "--draft-name", "draft.gguf", "--target-name", "target.gguf"])
    assert rc == 0
    for engine in ("vllm", "llamacpp", "sglang"):
        settings = json.loads((out / f"{engine}.json").read_text())
        assert settings["engine"] == engine and settings["cost_model"] == COST
    text = capsys.readouterr().out
    assert "llamacpp: confidence_opt (predicted speedup 1.550x)" in text
    with pytest.raises(SystemExit):
        main(["export", "--tuned", str(tmp_path / "tuned.json"), "--out", str(out), "--for", "trt"])
    assert "unknown engine(s) ['trt']" in capsys.readouterr().err
