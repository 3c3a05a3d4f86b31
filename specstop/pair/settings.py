"""The settings every command that loads a pair shares (``--pair``, ``--dtype`` ...), declared once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PairSettings:
    """Which draft/target pair to load, in which dtype, on which device."""

    pair: str | None = None
    """A known pair name or a folder with draft/ and target/ (or give draft and target)."""
    draft: str | None = None
    """Draft model folder or hub id (with target, instead of pair)."""
    target: str | None = None
    """Target model folder or hub id (with draft, instead of pair)."""
    dtype: str = "auto"
    """float32 | bfloat16 | float16 | auto (the pair's fastest for this command on this machine, timed
    once and cached)."""
    device: str | None = None
    """cpu | cuda | cuda:N; null = cuda when available."""
    draft_quant: str | None = None
    """int8 | int4: the draft's linear layers (output head included) in weight-only int8/int4, PyTorch's
    CPU kernels (specstop.pair.quantize); recorded in the pair's identity. null = the draft as loaded."""

    def pair_kwargs(self) -> dict:
        """The keyword arguments of :func:`specstop.pair.load_named_pair` these settings choose."""
        return {"draft": self.draft, "target": self.target, "dtype": self.dtype, "device": self.device,
                "draft_quant": self.draft_quant}


__all__ = ["PairSettings"]
