"""A StoppingPolicy drives transformers' assisted generation; greedy output equals plain generate."""

from __future__ import annotations

import pytest
import torch
from _export_fixtures import random_exports, single_thread, tiny_prompts  # noqa: F401

from specstop.decode.hf_assist import assisted_generate, use_policy
from specstop.export.runtime import StoppingPolicy


@pytest.mark.parametrize("name", ["static:3", "heuristic", "confidence:0.4", "disco", "sdpp"])
def test_assisted_greedy_equals_plain_generate(name, pair, exports):
    for ids in tiny_prompts(pair, ("hello world", "def f(x):")):
        x = torch.tensor([ids])
        ref = pair.target.generate(x, max_new_tokens=20, do_sample=False)
        policy = StoppingPolicy.load(exports.get(name, name), draft_identity=pair.draft_identity)
        with use_policy(pair.target, policy, vocab_size=pair.vocab_size) as info:
            out = pair.target.generate(x, assistant_model=pair.draft, max_new_tokens=20, do_sample=False)
        assert out[0].tolist() == ref[0].tolist(), name
        lengths = info["generator"].round_lengths
        assert lengths, "the policy's candidate generator was not used"
        if name == "static:3":
            assert max(lengths) == 3
    assert "_get_candidate_generator" not in vars(pair.target), "the hook must be removed after the block"


def test_assisted_sampling_runs(pair):
    ids = tiny_prompts(pair, ("hi",))[0]
    torch.manual_seed(0)
    out = assisted_generate(
        pair.target, pair.draft, StoppingPolicy.from_string("static:4"), torch.tensor([ids]),
        vocab_size=pair.vocab_size, max_new_tokens=12, do_sample=True, temperature=0.8,
    )
    assert out.shape[1] <= len(ids) + 12


# ------------------------------------------------------------------ tuned HF settings take effect

STATIC = {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
CONFIDENCE = {"num_assistant_tokens": 6, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.3}


@pytest.mark.parametrize("settings", [STATIC, CONFIDENCE], ids=["static", "confidence"])
def test_read_back_shows_the_tuned_k_and_threshold_run(settings, pair):
    from specstop.decode.hf_settings import read_back_hf_settings

    x = torch.tensor([tiny_prompts(pair, ("hello world",))[0]])
    before = {k: getattr(pair.draft.generation_config, k) for k in settings}
    fixed = read_back_hf_settings(pair.target, pair.draft, x, settings, max_new_tokens=40, do_sample=False)
    assert fixed["ok"], fixed["problems"]
    assert fixed["k_in_use"] == [settings["num_assistant_tokens"]]
    assert fixed["threshold_in_use"] == [settings["assistant_confidence_threshold"]]
    assert fixed["threshold_at_end"] == settings["assistant_confidence_threshold"] and not fixed["retuning"]
    assert max(fixed["drafted_per_round"]) <= settings["num_assistant_tokens"]
    if settings is STATIC:  # no confidence stop: every round but the last drafts exactly K
        assert set(fixed["drafted_per_round"][:-1]) == {3}
    assert {k: getattr(pair.draft.generation_config, k) for k in settings} == before  # the check restores the draft

    # The route hf.json used to write: generate() kwargs. transformers reads the draft's config instead,
    # so its defaults ran (20 tokens per round, threshold 0.4, then re-fitted online).
    kwargs = read_back_hf_settings(pair.target, pair.draft, x, settings, via="generate_kwargs", max_new_tokens=40,
                                   do_sample=False)
    assert not kwargs["ok"]
    assert kwargs["k_in_use"] == [20] and kwargs["drafted_per_round"] != fixed["drafted_per_round"]
    assert kwargs["threshold_at_end"] != settings["assistant_confidence_threshold"]


def test_without_the_fixed_generator_hf_retunes_the_threshold(pair):
    from specstop.decode.hf_settings import (
        apply_hf_settings,
        generate_with_settings,
        observe_assisted_generation,
    )

    x = torch.tensor([tiny_prompts(pair, ("hello world",))[0]])
    previous = apply_hf_settings(pair.draft, CONFIDENCE)  # the draft's config alone: K takes effect ...
    try:
        with observe_assisted_generation(pair.target) as seen:
            pair.target.generate(x, assistant_model=pair.draft, max_new_tokens=60, do_sample=False)
        assert {r["cap"] for r in seen["rounds"]} == {6}
        assert {r["threshold"] for r in seen["rounds"]} != {0.3}  # ... the threshold does not (ROC re-fit)
        ref = pair.target.generate(x, max_new_tokens=20, do_sample=False)
        out = generate_with_settings(pair.target, pair.draft, CONFIDENCE, x, max_new_tokens=20, do_sample=False)
        assert out[0].tolist() == ref[0].tolist()  # greedy assisted generation stays lossless
    finally:
        for key, value in previous.items():
            setattr(pair.draft.generation_config, key, value)
    assert "_get_candidate_generator" not in vars(pair.target)


def test_load_hf_settings_from_the_exported_file(tmp_path):
    import json

    from specstop.decode.hf_settings import load_hf_settings
    from specstop.errors import UserError
    from specstop.export.engines import engine_settings
    from specstop.policy import PolicySpec

    tuned = {"policies": {
        "static_opt": {"spec": PolicySpec(kind="static", k=4).to_dict(), "validation": {"speedup": 1.3}},
        "confidence_opt": {"spec": PolicySpec(kind="confidence", threshold=0.6, sl_max=9).to_dict(),
                           "validation": {"speedup": 1.5}}}}
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(engine_settings(tuned, "hf", draft="d", target="t")))
    assert load_hf_settings(path) == {"num_assistant_tokens": 9, "num_assistant_tokens_schedule": "constant",
                                      "assistant_confidence_threshold": 0.6}
    assert load_hf_settings(path, "static_opt")["num_assistant_tokens"] == 4
    with pytest.raises(UserError, match="no rule-based option 'x'"):
        load_hf_settings(path, "x")


# ------------------------------------------------------------------ the HF path refuses another draft

def test_hf_path_refuses_a_same_shaped_draft_with_other_weights(pair, exports):
    from specstop.decode.hf_assist import generate_with_policy
    from specstop.errors import UserError
    from specstop.testing import tiny_pair_models

    other, _, _ = tiny_pair_models(seed=7)  # same architecture and sizes, other weights
    assert sum(p.numel() for p in other.parameters()) == pair.draft_identity.num_parameters
    x = torch.tensor([tiny_prompts(pair, ("hello world",))[0]])
    for policy in (exports["disco"], StoppingPolicy.from_pretrained(exports["disco"])):  # a folder or a loaded policy
        with pytest.raises(UserError, match="not the draft this policy was exported for.*other weights") as err:
            generate_with_policy(pair.target, x, policy=policy, assistant_model=other, max_new_tokens=8, do_sample=False)
        assert "\n" not in str(err.value) and "allow_draft_mismatch=True" in str(err.value)
    ok = generate_with_policy(pair.target, x, policy=exports["disco"], assistant_model=pair.draft, max_new_tokens=8,
                              do_sample=False)
    anyway = generate_with_policy(pair.target, x, policy=exports["disco"], assistant_model=other, max_new_tokens=8,
                                  do_sample=False, allow_draft_mismatch=True)
    assert ok.shape[1] > x.shape[1] and anyway.shape[1] > x.shape[1]
    # Rule policies record no trained-for draft: any draft runs them.
    generate_with_policy(pair.target, x, policy=StoppingPolicy.from_string("static:3"), assistant_model=other,
                         max_new_tokens=8, do_sample=False)


def test_hf_path_compares_weight_files_for_drafts_loaded_from_folders(tiny_pair_dir, tmp_path):
    """A pair loaded from folders records the draft's file fingerprint; a draft loaded with
    from_pretrained is fingerprinted from the same files (and a same-shaped copy with other weights is not)."""
    from transformers import AutoModelForCausalLM

    from specstop.decode.hf_assist import assistant_identity, check_assistant
    from specstop.export.runtime import DraftMismatchError
    from specstop.pair.loader import load_pair
    from specstop.policy import PolicySpec
    from specstop.testing import tiny_pair_models

    loaded = load_pair(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), dtype="float32", device="cpu")
    assert loaded.draft_identity.weights_sha256.startswith("files-v1:")
    # What an export of this pair records in config.json.
    policy = StoppingPolicy.from_spec(PolicySpec(kind="static", k=3), config={"pair": loaded.to_dict()})
    same = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "draft")
    assert assistant_identity(same)["weights_sha256"] == loaded.draft_identity.weights_sha256
    check_assistant(policy, same)
    other, _, _ = tiny_pair_models(seed=7)
    other.save_pretrained(tmp_path / "other-draft")
    with pytest.raises(DraftMismatchError, match="other weights"):
        check_assistant(policy, AutoModelForCausalLM.from_pretrained(tmp_path / "other-draft"))
