"""The converted reference pair (slow: needs `specstop fetch-pair qwen2.5-coder-0.5b-1.5b` first)."""

from __future__ import annotations

import pytest
import torch

from specstop.pair.registry import KNOWN_PAIRS, is_converted, load_named_pair
from specstop.probs import DecodingConfig, logits_to_probs

REF = "qwen2.5-coder-0.5b-1.5b"
SNIPPET = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def factorial(n):
    """Return n factorial."""
    if n == 0:
        return 1
    return n * factorial(n - 1)
'''

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not is_converted(REF), reason=f"run `specstop fetch-pair {REF}` first"),
]


@pytest.fixture(scope="module")
def pair():
    return load_named_pair(REF, dtype="float32", device="cpu")


def test_identities_and_shared_tokenizer(pair):
    rec = KNOWN_PAIRS[REF]
    assert pair.draft_identity.architecture == pair.target_identity.architecture == "Qwen2ForCausalLM"
    assert pair.draft_identity.source_sha256 == rec.draft.sha256
    assert pair.target_identity.source_sha256 == rec.target.sha256
    assert 0.6e9 < pair.draft_identity.num_parameters < 0.66e9 and 1.7e9 < pair.target_identity.num_parameters < 1.8e9
    # Qwen pads its embedding matrix past the tokenizer.
    assert pair.vocab_size < pair.draft_identity.logits_size == pair.target_identity.logits_size == 151_936
    assert pair.tokenizer.eos_token == "<|im_end|>" and pair.tokenizer.chat_template


@torch.no_grad()
def test_greedy_next_token_agreement(pair):
    ids = torch.tensor([pair.tokenizer(SNIPPET)["input_ids"]])
    # Teacher-forced greedy next tokens at every position; compare the last 16.
    greedy = DecodingConfig()
    q = logits_to_probs(pair.draft(ids).logits[0, -16:], greedy, pair.vocab_size)
    p = logits_to_probs(pair.target(ids).logits[0, -16:], greedy, pair.vocab_size)
    agreement = (q.argmax(-1) == p.argmax(-1)).float().mean().item()
    print(f"greedy next-token agreement over 16 positions: {agreement:.2f}")
    assert agreement > 0.5


@pytest.mark.parametrize("spec", ["mcsd:4,2,2,1", "tree:16"])
def test_token_trees_are_lossless_on_the_reference_pair(pair, spec):
    # float32: verification blocks and single steps agree exactly, so any difference is a bug.
    from specstop.decode import TreeDecoder, parse_tree_policy
    from specstop.decode.chain import SpeculativeDecoder
    from specstop.export.runtime import StoppingPolicy

    prompt = pair.tokenizer(SNIPPET.split("def factorial")[0] + "def factorial(n):\n")["input_ids"]
    target = SpeculativeDecoder(pair, StoppingPolicy.from_string("static:1")).generate(prompt, 24, max_draft=0)
    tree = TreeDecoder(pair, parse_tree_policy(spec), DecodingConfig()).generate(prompt, 24)
    assert tree.token_ids == target.token_ids
    assert tree.counters["N_target"] < target.counters["N_target"]  # several tokens per target pass
