"""decode: the lossless decoders a stopping policy steers, and ``specstop decode``.

Chain speculative decoding (:mod:`chain`) supplies the pieces every decoder shares (``DecodeResult``,
EOS ids, the phase timer, the cached-model wrapper). Hugging Face ``generate`` runs a policy
through :mod:`hf_assist` (our candidate generator) or :mod:`hf_settings` (transformers' own
assisted generation with the settings ``specstop export --for hf`` writes); vLLM runs one through
:mod:`vllm_proposer` (a proposer class vLLM loads; this package never imports vLLM). ``cli`` is the
command.

Multi-candidate (token tree) decoding, imports flowing one way: ``token_tree`` (with the shapes of
:mod:`specstop.tree_policy`) <-
``drafting`` / ``verify`` / ``tree_cache`` <- ``tree_decoder``; ``node_head`` (the learned node
scorer, from ``specstop.models.tree_node``) is handed to ``tree_decoder`` by its caller.

PEARL (draft and target in parallel): ``pearl_spec`` <- ``pearl_server`` <- ``pearl_workers`` <- ``pearl``
<- ``pearl_timing``.

Batched chain decoding (B prompts at once, acceptance per sequence): ``batched``.

Multi-level speculation (a draft for a middle model for the target, each level verifying the one below
with the chain's rules): ``multilevel``, on ``chain``'s pieces.
"""

from specstop.decode.batched import BatchDecodeResult, BatchedSpeculativeDecoder
from specstop.decode.multilevel import MultiLevelDecoder
from specstop.decode.pearl import PearlDecoder
from specstop.decode.pearl_spec import PearlSpec, parse_pearl_policy
from specstop.decode.pearl_workers import PearlWorkers, WorkerError
from specstop.decode.tree_decoder import TreeDecoder
from specstop.tree_policy import DynamicTreeShape, StaticTreeShape, parse_tree_policy

__all__ = [
    "BatchDecodeResult",
    "BatchedSpeculativeDecoder",
    "DynamicTreeShape",
    "MultiLevelDecoder",
    "PearlDecoder",
    "PearlSpec",
    "PearlWorkers",
    "StaticTreeShape",
    "TreeDecoder",
    "WorkerError",
    "parse_pearl_policy",
    "parse_tree_policy",
]
