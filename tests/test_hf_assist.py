"""A StoppingPolicy drives transformers' assisted generation; greedy output equals plain generate."""

from __future__ import annotations

import pytest
import torch
from _export_fixtures import random_exports, single_thread, tiny_prompts  # noqa: F401

from specstop.export.hf_assist import assisted_generate, use_policy
from specstop.export.runtime import StoppingPolicy
from specstop.testing import tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def exports(tmp_path_factory, pair):
    return random_exports(tmp_path_factory.mktemp("exports"), pair)


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
