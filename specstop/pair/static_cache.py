"""Static KV caches (HF ``StaticCache``): their length per request, and moving their write position back.

A static cache has fixed shapes, which is what lets ``torch.compile`` turn a model's step into one graph
(no per-kernel launches); the decoders and the timings that price them share these two helpers.
"""

from __future__ import annotations

__all__ = ["CACHE_BUCKETS", "compiled_forward", "rewind", "static_cache_length"]

#: Static cache lengths a compiled model meets in practice (256, 512, ... up to the caller's limit).
CACHE_BUCKETS = 4


def static_cache_length(needed: int, limit: int) -> int:
    """A static KV cache's length for a request that needs ``needed`` positions: the next power of two
    from 256 on, at most ``limit``. A compiled step's graph is specialised to its cache's length, so a
    few lengths serve every request; and a short request's steps do not attend over ``limit`` masked
    positions each."""
    length = 256
    while length < needed:
        length *= 2
    return min(length, limit)


def rewind(cache, keep: int) -> None:
    """Set a ``StaticCache``'s logical length to ``keep`` tokens. Entries past it stay in memory, masked
    by position (every feed passes its ``cache_position``) and overwritten by the next feed."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.cumulative_length.fill_(keep)


def compiled_forward(model, graphs: int):
    """``torch.compile(model.forward)`` with static shapes, made once per model and kept on it, so every
    decoder and every request reuses its graphs (one per fed length and cache length).

    Args:
        model: the model whose forward to compile.
        graphs: how many graphs this caller needs of the forward's code object. Models of one class
            share that code object, whose recompile limit (8 by default) must hold all their graphs;
            it is raised to at least this many.
    """
    import torch
    import torch._dynamo

    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), int(graphs)))
    fn = getattr(model, "_specstop_compiled_forward", None)
    if fn is None:
        fn = torch.compile(model.forward, dynamic=False, fullgraph=False)
        model._specstop_compiled_forward = fn
    return fn
