"""`specstop export --for ENGINE`: the tuned settings each engine accepts, with their prediction."""

from __future__ import annotations

import json
import shlex

import pytest

from specstop.cli import main
from specstop.errors import UserError
from specstop.export.engines import ENGINES, engine_settings, llamacpp_flags, validate_engine_file
from specstop.export.engines.vllm import VLLM_WORKER_CLASS
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
    # Set on the draft's generation_config (transformers 5 ignores them as generate() kwargs).
    assert "generate_kwargs" not in hf["options"]["static_opt"]
    assert hf["options"]["static_opt"]["assistant_generation_config"] == {
        "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    heur = hf["options"]["heuristic_opt"]["assistant_generation_config"]
    assert heur["num_assistant_tokens_schedule"] == "heuristic_transient"  # restarts per call, as the replay does
    conf = hf["options"]["confidence_opt"]
    assert conf["assistant_generation_config"] == {"num_assistant_tokens": 12, "num_assistant_tokens_schedule": "constant",
                                                   "assistant_confidence_threshold": 0.62}
    assert "generation_config" in hf["note_hf"] and "generate_with_settings" in conf["usage"]
    assert hf["recommended"] == "confidence_opt" and conf["predicted"]["speedup"] == 1.55
    assert hf["cost_model"] == COST  # the calibration the prediction assumes

    vllm = engine_settings(tuned, "vllm", draft="d", target="t")
    assert list(vllm["options"]) == ["static_opt", "heuristic_opt", "confidence_opt"]
    # a fixed K: vLLM's own draft-model proposer; the confidence rule: specstop's stop inside that same runner
    # (vLLM's worker with specstop's proposer); the heuristic: specstop's proposer class
    assert vllm["options"]["static_opt"]["speculative_config"] == {"model": "d", "num_speculative_tokens": 4}
    conf = vllm["options"]["confidence_opt"]
    assert conf["speculative_config"] == {"method": "draft_model", "model": "d",
                                          "num_speculative_tokens": 12}  # SL_max: vLLM's cap on every draft
    assert conf["worker_cls"] == "specstop.decode.vllm_worker.SpecstopWorker" and conf["async_scheduling"] is False
    assert conf["additional_config"] == {"specstop": {"policy": tuned["policies"]["confidence_opt"]["spec"]}}
    assert "--additional-config" in conf["command"] and "pip install specstop" in conf["note"]
    assert "--worker-cls specstop.decode.vllm_worker.SpecstopWorker --no-async-scheduling" in conf["command"]
    heur = vllm["options"]["heuristic_opt"]
    assert heur["speculative_config"]["model"] == "specstop.decode.vllm_proposer.SpecstopProposer"
    assert heur["additional_config"]["specstop"]["draft"] == "d"
    assert vllm["recommended"] == "confidence_opt"

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

    trt = engine_settings(tuned, "trtllm", draft="d", target="t")
    assert trt["options"]["static_opt"]["llm_api_options"]["speculative_config"] == {
        "decoding_type": "Draft_Target", "max_draft_len": 4, "speculative_model": "d"}
    for engine in ENGINES:
        validate_engine_file(engine, json.loads(json.dumps(engine_settings(tuned, engine, draft="d", target="t"))))


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
    with pytest.raises(ValueError, match="sglang can express"):
        engine_settings(tuned, "sglang")
    for name in ("heuristic_opt", "confidence_opt"):
        del tuned["policies"][name]
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
    assert main(["export", "--tuned", str(tmp_path / "tuned.json"), "--out", str(out), "--for", "trt"]) == 2
    assert "unknown engine(s) ['trt']" in capsys.readouterr().err


SCHEDULE = {
    "format": 1,
    "cost_model": "batched-cost-v1",
    "entries": [
        {"batch_size": 1, "k": 4, "predicted_speedup": 1.42, "predicted_speedup_by_k": {"0": 1.0, "2": 1.33, "4": 1.42},
         "threshold": {"threshold": 0.55, "sl_max": 8, "predicted_speedup": 1.47}},
        {"batch_size": 4, "k": 6, "predicted_speedup": 1.25, "predicted_speedup_by_k": {"0": 1.0, "4": 1.21, "6": 1.25},
         "threshold": None},
        {"batch_size": 16, "k": 2, "predicted_speedup": 1.08, "predicted_speedup_by_k": {"0": 1.0, "2": 1.08},
         "threshold": None},
        {"batch_size": 64, "k": 0, "predicted_speedup": 1.0, "predicted_speedup_by_k": {"0": 1.0}, "threshold": None},
    ],
}


def _scheduled(tmp_path) -> dict:
    tuned = _tuned(tmp_path)
    tuned["batch_schedule"] = json.loads(json.dumps(SCHEDULE))
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    return tuned


def test_batch_schedule_in_each_engines_format(tmp_path):
    tuned = _scheduled(tmp_path)

    trt = engine_settings(tuned, "trtllm", draft="d", target="t")["batch_schedule"]
    conf = trt["llm_api_options"]["speculative_config"]
    # TensorRT-LLM: schedule[smallest key] == max_draft_len and every length <= it, so K 6 at batch 4 is capped at 4
    assert conf["max_draft_len"] == 4 and conf["draft_len_schedule"] == {"1": 4, "4": 4, "16": 2, "64": 0}
    row4 = trt["by_batch_size"][1]
    assert row4 == {"batch_size": 4, "k": 4, "predicted_speedup": 1.21, "tuned_k": 6}  # the capped K's own prediction
    assert any("lowered" in n for n in trt["notes"]) and trt["cost_model"] == "batched-cost-v1"

    vllm = engine_settings(tuned, "vllm", draft="d", target="t")["batch_schedule"]
    assert vllm["speculative_config"]["num_speculative_tokens"] == 6  # the startup maximum
    # vLLM's draft-model path runs the draft at K = 0 too, so the batch size the schedule leaves bare drafts one
    # token; the replay priced no K = 1 there, so it carries no prediction
    assert vllm["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 3, 4], [4, 15, 6], [16, 63, 2], [64, 64, 1]]
    assert [r["predicted_speedup"] for r in vllm["by_batch_size"]] == [1.42, 1.25, 1.08, None]
    assert vllm["by_batch_size"][3]["tuned_k"] == 0 and any("draft-model path" in n for n in vllm["notes"])

    sg = engine_settings(tuned, "sglang", draft="d", target="t")["batch_schedule"]
    assert sg["adaptive_config"] == {"1": {"candidate_steps": [4]}, "4": {"candidate_steps": [6]},
                                     "16": {"candidate_steps": [2]}, "64": {"candidate_steps": [0]}}
    flags = sg["flags"]
    assert "--speculative-adaptive" in flags and flags[flags.index("--speculative-num-steps") + 1] == "4"

    lc = engine_settings(tuned, "llamacpp", draft="d.gguf", target="t.gguf")["batch_schedule"]["by_batch_size"]
    assert lc[0]["flags"][-2:] == ["--spec-draft-p-min", "0.55"] and lc[0]["predicted_speedup"] == 1.47
    assert "--parallel" in shlex.split(lc[1]["command"]) and lc[1]["k"] == 6
    assert lc[3]["flags"] == [] and "-md" not in lc[3]["command"]  # K = 0: no draft model at that batch size

    assert "batch_schedule" not in engine_settings(tuned, "hf", draft="d", target="t")  # HF assisted generation: batch 1
    # specstop's stop in vLLM's runner drafts its SL_max only where the schedule speculates and nothing at batch
    # size 64 (it skips the draft's forward there, as specstop's proposer does)
    opts = engine_settings(tuned, "vllm", draft="d", target="t")["options"]
    conf = opts["confidence_opt"]["speculative_config"]
    assert opts["confidence_opt"]["worker_cls"]
    assert conf["num_speculative_tokens_per_batch_size"] == [[1, 3, 12], [4, 15, 12], [16, 63, 12], [64, 64, 0]]
    assert "skips the draft's forward" in opts["confidence_opt"]["batch_caps_note"]
    heur = opts["heuristic_opt"]["speculative_config"]
    assert heur["method"] == "custom_class" and heur["num_speculative_tokens_per_batch_size"][-1] == [64, 64, 0]
    assert json.dumps(conf) in shlex.split(opts["confidence_opt"]["command"])  # the command carries it too
    assert "num_speculative_tokens_per_batch_size" not in opts["static_opt"]["speculative_config"]
    for engine in ENGINES:
        validate_engine_file(engine, json.loads(json.dumps(engine_settings(tuned, engine, draft="d", target="t"))))


def test_export_writes_schedule_side_files(tmp_path, capsys):
    import yaml

    _scheduled(tmp_path)
    out = tmp_path / "engines"
    assert main(["export", "--tuned", str(tmp_path / "tuned.json"), "--out", str(out), "--for", "trtllm,sglang,vllm",
                 "--draft-name", "d", "--target-name", "t"]) == 0
    opts = yaml.safe_load((out / "trtllm_batch_schedule.yaml").read_text())
    assert opts["speculative_config"]["draft_len_schedule"] == {1: 4, 4: 4, 16: 2, 64: 0}  # integer keys
    assert yaml.safe_load((out / "trtllm_static_opt.yaml").read_text())["speculative_config"]["max_draft_len"] == 4
    assert json.loads((out / "sglang_adaptive.json").read_text())["16"] == {"candidate_steps": [2]}
    text = capsys.readouterr().out
    assert "batch schedule [B1: K=4 1.42x, B4: K=6 1.25x" in text


@pytest.mark.parametrize("engine, edit, message", [
    ("trtllm", lambda d: d["batch_schedule"]["llm_api_options"]["speculative_config"]["draft_len_schedule"].update(
        {"1": 3}), "must equal max_draft_len"),
    ("trtllm", lambda d: d["options"]["static_opt"]["llm_api_options"]["speculative_config"].update(
        {"max_draft_len": 0}), "max_draft_len must be an integer > 0"),
    ("vllm", lambda d: d["batch_schedule"]["speculative_config"]["num_speculative_tokens_per_batch_size"].__setitem__(
        0, [2, 3, 4]), "must start at 1"),
    ("vllm", lambda d: d["batch_schedule"]["speculative_config"]["num_speculative_tokens_per_batch_size"].__setitem__(
        1, [3, 15, 6]), "non-overlapping"),
    ("vllm", lambda d: d["batch_schedule"]["speculative_config"]["num_speculative_tokens_per_batch_size"].__setitem__(
        1, [4, 15, 9]), "clamps"),
    ("vllm", lambda d: d["options"]["heuristic_opt"]["speculative_config"].update({"model": "my.Proposer"}),
     "must name specstop.decode.vllm_proposer.SpecstopProposer"),
    ("vllm", lambda d: d["options"]["heuristic_opt"].pop("additional_config"), "additional_config.specstop.draft"),
    ("vllm", lambda d: d["options"]["confidence_opt"].pop("additional_config"), "additional_config.specstop must hold"),
    ("vllm", lambda d: d["options"]["confidence_opt"].update({"worker_cls": "my.Worker"}), "worker_cls must be"),
    ("vllm", lambda d: d["options"]["confidence_opt"].update({"async_scheduling": True}), "async_scheduling must be"),
    ("vllm", lambda d: d["options"]["confidence_opt"]["additional_config"]["specstop"]["policy"].update(
        {"kind": "heuristic"}), "does not run a 'heuristic' policy"),
    ("vllm", lambda d: d["options"]["confidence_opt"].update(speculative_config={
        **d["options"]["confidence_opt"]["speculative_config"], "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 100, 4]]}), "drafts up to 12 tokens"),
    ("vllm", lambda d: d["options"]["confidence_opt"]["additional_config"]["specstop"]["policy"].update(
        {"threshold": 3.0}), "threshold"),
    ("vllm", lambda d: d["options"]["static_opt"]["speculative_config"].update({"method": "eagle"}),
     "must be draft_model or custom_class"),
    ("sglang", lambda d: d["batch_schedule"]["adaptive_config"].update({"4": {"candidate_steps": []}}),
     "non-empty list"),
    ("sglang", lambda d: d["batch_schedule"]["adaptive_config"].pop("1"), "ascend from 1"),
    ("llamacpp", lambda d: d["batch_schedule"]["by_batch_size"].reverse(), "ascending"),
    ("llamacpp", lambda d: d["options"]["confidence_opt"]["flags"].__setitem__(-1, "1.5"), "p-min in"),
    ("hf", lambda d: d["options"]["static_opt"]["assistant_generation_config"].update(
        {"num_assistant_tokens_schedule": "adaptive"}), "num_assistant_tokens_schedule must be one of"),
    ("hf", lambda d: d["options"]["static_opt"]["assistant_generation_config"].update(
        {"num_assistant_tokens": 0}), "num_assistant_tokens must be an integer >= 1"),
])
def test_validate_engine_file_refuses_what_the_engine_refuses(tmp_path, engine, edit, message):
    data = json.loads(json.dumps(engine_settings(_scheduled(tmp_path), engine, draft="d", target="t")))
    validate_engine_file(engine, data)
    edit(data)
    with pytest.raises(UserError, match=message) as err:
        validate_engine_file(engine, data)
    assert "\n" not in str(err.value) and "re-export" in str(err.value)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(format=2), "format 2"),
    (lambda s: s["entries"][1].update(batch_size=1), "must ascend"),
    (lambda s: s["entries"][1].update(k=-1), "not an integer >= 0"),
    (lambda s: s["entries"][0].update(threshold={"threshold": 2.0, "sl_max": 8}), "threshold must be null"),
])
def test_malformed_batch_schedule_is_a_user_error(tmp_path, edit, message):
    tuned = _scheduled(tmp_path)
    edit(tuned["batch_schedule"])
    with pytest.raises(UserError, match=message):
        engine_settings(tuned, "vllm", draft="d", target="t")


def test_schedule_without_speculation_anywhere(tmp_path):
    tuned = _scheduled(tmp_path)
    for e in tuned["batch_schedule"]["entries"]:
        e["k"], e["threshold"] = 0, None
    trt = engine_settings(tuned, "trtllm", draft="d", target="t")
    assert trt["batch_schedule"]["llm_api_options"] == {} and "--extra_llm_api_options" not in trt["batch_schedule"]["command"]
    vllm = engine_settings(tuned, "vllm", draft="d", target="t")
    assert vllm["batch_schedule"]["speculative_config"] is None
    for engine in ("trtllm", "vllm", "sglang", "llamacpp"):
        validate_engine_file(engine, json.loads(json.dumps(engine_settings(tuned, engine, draft="d", target="t"))))


def test_a_file_where_nothing_pays_recommends_no_speculation(tmp_path):
    """Every option predicted slower than the engine alone: no recommendation, a line saying so, and the file
    says whose costs priced it."""
    tuned = _tuned(tmp_path)
    for entry in tuned["policies"].values():
        entry["validation"]["speedup"] = 0.9
    tuned["cost_model"] = {**COST, "provenance": "measured", "name": "vllm_cost.json", "machine": {"engine": "vllm 0.32.0"}}
    from specstop.export.engines import summary_line

    vllm = engine_settings(tuned, "vllm", draft="d", target="t")
    assert vllm["recommended"] is None and "serve without speculation" in vllm["no_speculation"]
    assert vllm["priced_by"].startswith("vllm's own costs, measured inside vllm 0.32.0")
    assert summary_line(vllm).startswith("vllm: no speculation recommended")
    lc = engine_settings(tuned, "llamacpp", draft="d.gguf", target="t.gguf")
    assert "not llamacpp's: an estimate" in lc["priced_by"]
    validate_engine_file("vllm", json.loads(json.dumps(vllm)))


def test_vllm_options_with_a_quantized_draft(tmp_path, capsys):
    """--draft-quant int4: every rule runs in vLLM's batched runner with the int4 draft (static K too), the
    heuristic through specstop's proposer; the learned option is kept only where its export was trained on the
    int4 draft's features; and the file says whose draft's costs priced it."""
    tuned = _tuned(tmp_path)
    tuned["policies"]["disco"] = {"spec": PolicySpec(kind="predictor", family="disco_ffn", threshold=0.5, sl_max=6,
                                                     reads="dist").to_dict(),
                                  "validation": {"speedup": 1.6, "latency_per_token": 0.02, "tokens_per_round": 3.0}}
    exports = {}
    for quant in ("int4", None):
        folder = tmp_path / f"export_{quant}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"pair": {"draft": {"quant": quant}}}))
        exports[quant] = str(folder)
    vllm = engine_settings(tuned, "vllm", draft="d", target="t", draft_quant="int4", hf_export=("disco", exports["int4"]))
    assert list(vllm["options"]) == ["static_opt", "heuristic_opt", "confidence_opt", "disco"]
    for name, opt in vllm["options"].items():
        assert opt["additional_config"]["specstop"]["draft_quant"] == "int4", name
        runner = name != "heuristic_opt"
        assert (opt.get("worker_cls") == VLLM_WORKER_CLASS) == runner, name
        assert opt["speculative_config"]["method"] == ("draft_model" if runner else "custom_class"), name
        assert ("--worker-cls" in opt["command"]) == runner and "draft_quant" in opt["command"], name
    assert vllm["options"]["static_opt"]["additional_config"]["specstop"]["policy"]["kind"] == "static"
    assert vllm["options"]["disco"]["additional_config"]["specstop"]["policy"] == exports["int4"]
    # an export trained on the float draft's features would be refused by the int4 runner: left out
    floats = engine_settings(tuned, "vllm", draft="d", target="t", draft_quant="int4", hf_export=("disco", exports[None]))
    assert "disco" not in floats["options"]
    # and without --draft-quant, the float export runs in the runner with vLLM's own draft
    plain = engine_settings(tuned, "vllm", draft="d", target="t", hf_export=("disco", exports[None]))
    assert "draft_quant" not in plain["options"]["disco"]["additional_config"]["specstop"]
    assert vllm["draft_quant"]["scheme"] == "int4" and "calibrate-cost --engine vllm --draft-quant int4" in \
        vllm["draft_quant"]["note"]
    validate_engine_file("vllm", json.loads(json.dumps(vllm)))
    for name in ("confidence_opt", "heuristic_opt"):  # the runner's setting and the proposer's
        bad = json.loads(json.dumps(vllm))
        bad["options"][name]["additional_config"]["specstop"]["draft_quant"] = "int3"
        with pytest.raises(UserError, match="draft_quant must be one of int8, int4"):
            validate_engine_file("vllm", bad)
    assert main(["export", "--tuned", str(tmp_path / "tuned.json"), "--out", str(tmp_path / "x"), "--for", "llamacpp",
                 "--draft-quant", "int4"]) == 2
    assert "--draft-quant applies to --for vllm" in capsys.readouterr().err
