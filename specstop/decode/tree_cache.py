"""One model's KV cache under tree attention: feed tree nodes, then keep only the accepted path.

How a plain Hugging Face causal LM (Qwen2, Llama, ...) runs a tree forward in transformers 5: pass
``attention_mask`` as a 4D float tensor ``[1, 1, n_new, past + n_new]`` (0 = attend, ``finfo.min``
= masked) together with explicit ``position_ids``. ``masking_utils._preprocess_mask_arguments``
returns any 4D mask as is ("it was already prepared, or it is custom"), and both the ``eager``
(adds the mask to the scores) and ``sdpa`` (passes it as ``attn_mask``) attention implementations
accept it. ``flash_attention_*`` takes no arbitrary mask and ``flex_attention`` wants a BlockMask,
so tree decoding needs ``eager`` or ``sdpa`` (the default on CPU and for most models).

The cache is an HF ``DynamicCache``: new keys/values are appended in feed order, so after a round
the accepted path's entries are scattered among rejected siblings. :meth:`TreeLM.keep_path`
gathers them back into a contiguous prefix (``layer.keys[:, :, idx]``), after which the cache is
exactly what a causal forward over the accepted sequence would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specstop.decode.chain import _LM
from specstop.decode.token_tree import tree_attention_mask
from specstop.errors import UserError
from specstop.pair.compat import cache_kwarg

__all__ = ["TreeLM", "check_tree_attention"]

TREE_ATTENTION_IMPLS = ("eager", "sdpa")


def check_tree_attention(model) -> None:
    """Refuse, in one line, a model whose attention implementation cannot take a custom 4D mask."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in TREE_ATTENTION_IMPLS:
        name = getattr(model.config, "name_or_path", None) or type(model).__name__
        raise UserError(
            f"{name} uses attention implementation {impl!r}, which takes no custom tree mask; load it with "
            "attn_implementation='sdpa' (or 'eager') for tree decoding"
        )


class TreeLM(_LM):
    """A model plus its ``DynamicCache``, fed in "regions" of tree nodes.

    A round starts a region after the cached prefix (:meth:`start_region`), feeds nodes into it in one
    or more forwards (:meth:`feed_nodes`; region node i sits in cache slot ``prefix + i``), and ends
    with :meth:`keep_path`, which keeps the prefix plus the chosen region slots.
    """

    def __init__(self, model) -> None:
        check_tree_attention(model)
        super().__init__(model, static_cache=False, max_len=0, compile=False)
        if any(getattr(layer, "sliding_window", None) for layer in getattr(self.cache, "layers", [])):
            # A sliding layer drops old slots itself: gathering the accepted path by slot would break.
            raise UserError(
                f"{type(model).__name__} has sliding-window attention layers; tree decoding needs full-attention "
                "KV caches (use the chain decoder, --policy static:K)"
            )
        self.prefix = 0
        self.region_parents: list[int] = []

    def start_region(self) -> None:
        """The cache holds exactly the sequence's first ``length`` tokens: the region starts after them."""
        self.prefix = self.length
        self.region_parents = []

    @torch.no_grad()
    def feed_nodes(self, tokens: Sequence[int], parents: Sequence[int], keep_logits: int | None = None) -> torch.Tensor:
        """Feed region nodes with tree attention.

        Args:
            tokens: the nodes' token ids.
            parents: each node's parent as a region slot (earlier in this or a previous feed), or -1
                for a node that follows the prefix directly.
            keep_logits: logits rows to return (the last ones; default all).

        Returns:
            ``[keep_logits, V_model]`` logits of the fed nodes.
        """
        n = len(tokens)
        self.region_parents.extend(int(p) for p in parents)
        dtype = next(self.model.parameters()).dtype
        mask, pos = tree_attention_mask(self.region_parents, self.prefix, n, dtype=dtype, device=self.device)
        keep = n if keep_logits is None else keep_logits
        out = self.forward(
            input_ids=torch.tensor([list(tokens)], device=self.device),
            attention_mask=mask,
            position_ids=pos,
            # Cache slots (where the keys land), not positions: some 5.x releases read it.
            cache_position=torch.arange(self.length, self.length + n, device=self.device),
            **cache_kwarg(self.model, self.cache),
            use_cache=True,
            logits_to_keep=keep,
        )
        self.length += n
        return out.logits[0, -keep:]

    def keep_path(self, slots: Sequence[int]) -> None:
        """Keep the prefix plus the given region slots (in order), dropping every other region entry.

        Args:
            slots: region slots forming the accepted path, in sequence order.
        """
        idx = list(range(self.prefix)) + [self.prefix + int(s) for s in slots]
        if len(idx) != self.length or any(a != b for a, b in zip(idx, range(self.length))):
            index = torch.tensor(idx, dtype=torch.long, device=self.device)
            for layer in self.cache.layers:
                if not getattr(layer, "is_initialized", False):
                    continue
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        self.length = len(idx)
        self.prefix = self.length
        self.region_parents = []
