"""One export, a policy per decoding setting: `specstop export --also-tuned` carries the same policy tuned at
other temperatures, and every decoder's request setting picks the one it runs."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from _export_fixtures import write_checkpoint, write_manifest, write_tuned

from specstop.errors import UserError
from specstop.export.by_decoding import describe, pick
from specstop.export.export import ExportError, export_from_files
from specstop.export.runtime import StoppingPolicy
from specstop.policy import PolicySpec
from specstop.probs import DecodingConfig
from specstop.testing import tiny_pair

GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}


def _entry(t: float, top_k: int = 0, top_p: float = 1.0) -> dict:
    return {"decoding": {"temperature": t, "top_k": top_k, "top_p": top_p}}


def test_pick_serves_greedy_with_greedy_and_sampling_with_the_nearest_temperature():
    entries = [_entry(0.0), _entry(0.7, top_p=0.9), _entry(0.7), _entry(1.0)]
    assert pick(entries, DecodingConfig()) == 0
    assert pick(entries, DecodingConfig(temperature=0.7, top_p=0.9)) == 1
    assert pick(entries, DecodingConfig(temperature=0.7)) == 2  # the same cuts before another's
    assert pick(entries, DecodingConfig(temperature=0.75, top_k=50)) == 2  # nearest; no top-k entry: the lower T
    assert pick(entries, DecodingConfig(temperature=0.9)) == 3
    assert pick(entries, DecodingConfig(temperature=0.1)) == 2  # a sampled request never gets the greedy entry
    assert pick([_entry(0.7), _entry(1.0)], DecodingConfig()) == 0  # no greedy entry: the lowest temperature
    assert pick([_entry(0.0)], DecodingConfig(temperature=1.0)) == 0
    assert describe(_entry(0.7, top_k=50, top_p=0.9)["decoding"]) == "T=0.7, top-k 50, top-p 0.9"
    assert describe(GREEDY) == "greedy"


@pytest.fixture
def setup(tmp_path):
    """A tiny pair, greedy and T = 1 datasets of it, a DISCO checkpoint tuned on each (different thresholds)."""
    torch.set_num_threads(1)
    pair = tiny_pair(seed=3)
    greedy, hot = write_manifest(tmp_path / "greedy", pair), write_manifest(tmp_path / "hot", pair, temperature=1.0)
    ckpt = tmp_path / "disco.ckpt"
    write_checkpoint(ckpt, "disco_ffn", label="accept_expected", seed=1)

    def tuned(name: str, data, threshold: float, sl_max: int, checkpoint=ckpt):
        spec = PolicySpec(kind="predictor", family="disco_ffn", threshold=threshold, sl_max=sl_max, reads="dist")
        rules = {"confidence_opt": PolicySpec(kind="confidence", threshold=threshold, sl_max=sl_max)}
        return write_tuned(tmp_path / f"{name}.json", {"disco_ffn": spec, **rules}, data, {"disco_ffn": checkpoint},
                           best="disco_ffn")

    return pair, tmp_path, tuned("greedy", greedy, 0.3, 12), tuned("hot", hot, 0.6, 4), tuned


def test_an_export_carries_each_settings_thresholds_and_decoders_pick_by_the_request(setup, caplog):
    from specstop.decode.chain import SpeculativeDecoder
    from specstop.decode.hf_assist import decoding_from_generation_config

    pair, tmp, greedy, hot, _ = setup
    out = tmp / "export"
    config = export_from_files(out, tuned=greedy, policy="disco_ffn", also_tuned=[hot])
    assert [e["decoding"]["temperature"] for e in config["by_decoding"]] == [0.0, 1.0]
    assert json.loads((out / "config.json").read_text())["by_decoding"][1]["policy"]["threshold"] == 0.6

    policy = StoppingPolicy.from_pretrained(out, draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash)
    assert policy.spec.threshold == 0.3 and policy.setting["temperature"] == 0.0
    assert policy.configure(DecodingConfig(temperature=0.9)).spec.threshold == 0.6 and policy.spec.sl_max == 4
    assert policy.setting["temperature"] == 1.0 and policy.label == "disco_ffn @ T=1"
    assert policy.configure(DecodingConfig()).spec.threshold == 0.3  # and back, per request

    for decoding, threshold in ((DecodingConfig(), 0.3), (DecodingConfig(temperature=1.0, top_p=0.9), 0.6)):
        caplog.clear()  # the export's own info lines (kept when an earlier test set specstop's level to INFO)
        with caplog.at_level(logging.WARNING, logger="specstop"):
            dec = SpeculativeDecoder(pair, StoppingPolicy.from_pretrained(out, draft_identity=pair.draft_identity),
                                     decoding)
        # each request runs numbers tuned at its temperature: nothing to warn
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert dec.policy.spec.threshold == threshold
        res = dec.generate([1, 2, 3], 6, seed=0)
        assert max(res.round_lengths) <= (12 if threshold == 0.3 else 4)
    from transformers import GenerationConfig

    hf = decoding_from_generation_config(GenerationConfig(do_sample=True, temperature=1.0, top_k=0))
    assert StoppingPolicy.from_pretrained(out).configure(hf).spec.threshold == 0.6  # HF's hook, a sampled request
    for bad in ({"top_k": 2.5}, {"temperature": "hot"}):  # transformers takes both; was truncated / a ValueError
        with pytest.raises(UserError, match=f"generation_config.{next(iter(bad))} must be"):
            decoding_from_generation_config(GenerationConfig(do_sample=True, **bad))

    greedy_only = export_from_files(tmp / "greedy_only", tuned=greedy, policy="disco_ffn") and tmp / "greedy_only"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # specstop's one line, not a Python warning with file, line and source
        with caplog.at_level(logging.WARNING, logger="specstop"):
            SpeculativeDecoder(pair, StoppingPolicy.from_pretrained(greedy_only), DecodingConfig(temperature=1.0))
    [line] = [r.getMessage() for r in caplog.records if "tuned on data made" in r.getMessage()]
    assert "tuned on data made at temperature 0, decoding runs at 1: its thresholds" in line and "\n" not in line

    rules = export_from_files(tmp / "rules", tuned=greedy, policy="confidence_opt", also_tuned=[hot])
    assert [e["policy"]["kind"] for e in rules["by_decoding"]] == ["confidence", "confidence"]
    plain = StoppingPolicy.from_pretrained(export_from_files(tmp / "plain", tuned=greedy, policy="confidence_opt")
                                           and tmp / "plain")
    assert plain.setting is None and plain.configure(DecodingConfig(temperature=1.0)).spec.threshold == 0.3


def test_also_tuned_must_be_the_same_policy_on_the_same_pair_at_another_setting(setup):
    pair, tmp, greedy, hot, tuned = setup
    other_ckpt = tmp / "other.ckpt"
    write_checkpoint(other_ckpt, "disco_ffn", label="accept_expected", seed=9)
    retrained = tuned("retrained", tmp / "hot", 0.5, 8, checkpoint=other_ckpt)
    with pytest.raises(ExportError, match=r"tuned disco_ffn with checkpoint .*other.ckpt.*--checkpoint disco_ffn="):
        export_from_files(tmp / "e1", tuned=greedy, policy="disco_ffn", also_tuned=[retrained])
    copy = tmp / "copy.ckpt"
    copy.write_bytes((tmp / "disco.ckpt").read_bytes())
    same_bytes = tuned("copied", tmp / "hot", 0.5, 8, checkpoint=copy)
    export_from_files(tmp / "e2", tuned=greedy, policy="disco_ffn", also_tuned=[same_bytes])  # the same predictor
    with pytest.raises(ExportError, match="greedy is also by_decoding"):
        export_from_files(tmp / "e3", tuned=greedy, policy="disco_ffn", also_tuned=[greedy])
    lacking = write_tuned(tmp / "lacking.json", {"static_opt": PolicySpec(kind="static", k=3)}, tmp / "hot", {},
                          best="static_opt")
    with pytest.raises(ExportError, match="has no policy 'disco_ffn' .have: static_opt.: tune the same policy"):
        export_from_files(tmp / "e4", tuned=greedy, policy="disco_ffn", also_tuned=[lacking])
    assert not any((tmp / f"e{i}").exists() for i in (1, 3, 4))  # nothing half-written

    # A hand-edited export whose entries disagree with its policy is refused on load, in one line.
    export_from_files(tmp / "e5", tuned=greedy, policy="confidence_opt", also_tuned=[hot])
    cfg = json.loads((tmp / "e5" / "config.json").read_text())
    cfg["by_decoding"][1]["policy"] = PolicySpec(kind="static", k=3).to_dict()
    (tmp / "e5" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"by_decoding\[1\]: a static:3 policy beside the export's confidence:0.3"):
        StoppingPolicy.from_pretrained(tmp / "e5")


def test_the_export_cli_prints_each_setting(setup, capsys):
    from specstop.cli import main

    _pair, tmp, greedy, hot, _ = setup
    assert main(["export", "--tuned", str(greedy), "--policy", "confidence_opt", "--also-tuned", str(hot),
                 "--out", str(tmp / "cli")]) == 0
    out = capsys.readouterr().out
    assert "at greedy: confidence:0.3 (SL_max 12)" in out and "at T=1: confidence:0.6 (SL_max 4)" in out


@pytest.mark.parametrize("field, value, says", [
    ("temperature", "hot", r"temperature must be a number, got 'hot' \(a string\)"),  # was a raw ValueError
    ("temperature", [1.0], r"temperature must be a number, got \[1.0\] \(a list\)"),  # was a raw TypeError
    ("temperature", True, r"temperature must be a number, got True"),
    ("top_k", 2.5, r"top_k must be an integer >= 0 \(0 disables\), got 2.5"),  # was truncated to 2
    ("top_k", "5", r"top_k must be an integer >= 0 \(0 disables\), got '5'"),  # was read as 5
    ("top_p", 0, r"top_p must be > 0 and <= 1"),
    ("temprature", 1.0, r"unknown key 'temprature'"),  # was read as greedy
])
def test_a_by_decoding_setting_that_is_not_valid_is_one_line_naming_it(setup, field, value, says):
    _pair, tmp, greedy, hot, _ = setup
    export_from_files(tmp / "e", tuned=greedy, policy="confidence_opt", also_tuned=[hot])
    cfg = json.loads((tmp / "e" / "config.json").read_text())
    cfg["by_decoding"][1]["decoding"][field] = value
    (tmp / "e" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config.json: by_decoding\[1\].decoding[.:] ?" + says) as err:
        StoppingPolicy.from_pretrained(tmp / "e")
    assert "\n" not in str(err.value) and "re-export" in str(err.value)


def test_the_one_decoding_rule_holds_for_every_reader():
    for generation in ({"temperature": "0.7"}, {"top_k": 2.5}, {"top_k": "5"}, {"top_p": 1.5}, {"temperature": -1}):
        with pytest.raises(UserError, match="must be"):
            DecodingConfig.from_generation(generation)
        with pytest.raises(UserError, match="must be"):
            DecodingConfig(**{**GREEDY, **generation})
    with pytest.raises(UserError, match=r"by_decoding\[0\].decoding must be a mapping"):
        DecodingConfig.from_generation("greedy", "by_decoding[0].decoding")
    assert DecodingConfig.from_generation({"temperature": 1, "top_k": None, "max_new_tokens": 8}) == DecodingConfig(1.0)
    from specstop.config_io import check_named_settings

    with pytest.raises(UserError, match=r"data.top_k must be an integer >= 0 \(0 disables\), got 2.5"):
        check_named_settings({"data.top_k": 2.5})  # a config or flag's top-k: the same rule (was accepted)


@pytest.mark.parametrize("given", [{"temperature": 1.0}, "greedy", 0.7])
def test_configure_given_anything_but_a_decoding_config_says_what_to_build(given):
    policy = StoppingPolicy(PolicySpec(kind="confidence", threshold=0.5, sl_max=4))
    with pytest.raises(UserError, match=r"configure takes a specstop.probs.DecodingConfig, got .*from_generation"):
        policy.configure(given)  # was an AttributeError from deep inside
    assert policy.configure(None, 64).vocab_size == 64  # None keeps the setting


def test_pearls_label_names_the_entry_its_workers_run(setup):
    from specstop.decode.pearl import PearlDecoder
    from specstop.decode.pearl_spec import PearlSpec

    pair, tmp, greedy, hot, _ = setup
    export_from_files(tmp / "e", tuned=greedy, policy="confidence_opt", also_tuned=[hot])
    workers = object()  # no worker starts: the label is settled on construction
    sampled = PearlDecoder(pair, PearlSpec(3, stop=str(tmp / "e")), DecodingConfig(temperature=1.0), workers=workers)
    assert sampled.label.endswith("@ T=1") and sampled.stop_policy.spec.threshold == 0.6
    assert PearlDecoder(pair, PearlSpec(3, stop=str(tmp / "e")), workers=workers).label.endswith("@ greedy")


@pytest.mark.parametrize("extra", [["--also-tuned", "HOT"], ["--policy", "confidence_opt"], ["--checkpoint", "CKPT"],
                                   ["--data", "DATA", "--allow-missing-pair"]])
def test_package_options_without_the_package_are_refused_not_ignored(setup, capsys, extra):
    from specstop.cli import main

    _pair, tmp, greedy, hot, _ = setup
    extra = [{"HOT": str(hot), "CKPT": str(tmp / "disco.ckpt"), "DATA": str(tmp / "hot")}.get(a, a) for a in extra]
    out = tmp / "engines"
    assert main(["export", "--tuned", str(greedy), "--for", "vllm,llamacpp", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    flags = [a for a in extra if a.startswith("--")]
    assert len(err.splitlines()) == 1 and f"{', '.join(flags)} shape" in err
    assert "which --for vllm,llamacpp does not write" in err and "add hf to --for" in err
    assert not out.exists()  # refused before anything is written


def test_for_hf_without_policy_says_what_it_packages_when_that_is_not_best(setup, capsys):
    from specstop.cli import main
    from specstop.export.cli import _learned_policy

    _pair, tmp, greedy, hot, _ = setup
    tuned = json.loads(greedy.read_text())
    tuned["best"] = "confidence_opt"
    (tmp / "best_rule.json").write_text(json.dumps(tuned))
    assert _learned_policy(str(tmp / "best_rule.json"), None) == "disco_ffn"
    said = capsys.readouterr().out
    assert "packaging disco_ffn" in said and "--policy confidence_opt packages it instead" in said
    assert _learned_policy(str(greedy), None) == "disco_ffn" and not capsys.readouterr().out  # best: nothing to say
    assert _learned_policy(str(greedy), "confidence_opt") == "confidence_opt"
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    helped = " ".join(capsys.readouterr().out.split())  # --help says what an omitted --policy packages
    assert "null = the tuned file's 'best' (with --for hf or all: its learned predictor of the lowest" in helped


def test_also_tuned_on_a_dataset_whose_recorded_setting_is_not_valid_is_one_line_naming_it(setup):
    _pair, tmp, greedy, hot, _ = setup
    manifest = json.loads((tmp / "hot" / "manifest.json").read_text())
    manifest["generation"]["top_k"] = 2.5  # was truncated to top-k 2
    (tmp / "hot" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"--also-tuned .*hot.json: its dataset .*hot: manifest generation.top_k must "
                                          r"be an integer >= 0 \(0 disables\), got 2.5"):
        export_from_files(tmp / "e", tuned=greedy, policy="confidence_opt", also_tuned=[hot])
    assert not (tmp / "e").exists()
