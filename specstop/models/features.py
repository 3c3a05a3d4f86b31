"""Feature specification: how a predictor's input vector is built from draft features.

The same :class:`FeatureSpec` builds inputs in training (from dataset arrays), in replay (from
dataset arrays) and at decode time (from live draft logits/hidden states), so the three cannot
drift apart. It is saved into exports.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from specstop.errors import UserError
from specstop.probs import entropy as _entropy
from specstop.probs import top_k_probs

DIST = "dist"  # top-k probabilities + entropy (+ position) of q_i: DISCO, MCSD top-k
HIDDEN = "hidden"  # the draft's final hidden state after the token is fed in: SpecDec++, MCSD hidden


@dataclass(frozen=True)
class FeatureSpec:
    """What a predictor reads.

    Attributes:
        kind: ``"dist"`` or ``"hidden"``.
        k: number of top probabilities (dist).
        use_position: append the encoded response position (dist).
        position_scale: positions are encoded as ``log1p(i) / log1p(position_scale)``: raw
            positions grow without bound and would dominate an unnormalised FFN; the log keeps
            early positions (where behaviour changes most) distinct and late ones bounded-ish
            (position_scale maps to 1.0; 4x further only reaches ~1.2).
        hidden_size: draft hidden width (hidden).
        hidden_layer: which draft layer's output (-1 = final, after the final norm).
    """

    kind: str
    k: int = 10
    use_position: bool = False
    position_scale: float = 1024.0
    hidden_size: int = 0
    hidden_layer: int = -1

    def __post_init__(self) -> None:
        if self.kind not in (DIST, HIDDEN):
            raise UserError(f"feature kind must be {DIST!r} or {HIDDEN!r}, got {self.kind!r}")
        if self.kind == HIDDEN and self.hidden_size <= 0:
            raise UserError("a hidden-state predictor needs hidden_size > 0 (the draft's hidden width)")

    @property
    def input_dim(self) -> int:
        if self.kind == HIDDEN:
            return self.hidden_size
        return self.k + 1 + int(self.use_position)

    @property
    def reads_hidden(self) -> bool:
        return self.kind == HIDDEN

    def to_dict(self) -> dict:
        return asdict(self)

    def encode_position(self, position: torch.Tensor) -> torch.Tensor:
        """``[B]`` int positions -> ``[B]`` float features."""
        return torch.log1p(position.float().clamp_min(0)) / math.log1p(self.position_scale)

    def build(
        self,
        topk: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        position: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Assemble the ``[B, input_dim]`` float32 input.

        Args:
            topk: ``[B, >=k]`` sorted top probabilities (dist). entropy: ``[B]`` nats (dist).
            position: ``[B]`` 0-based response positions (dist with use_position).
            hidden: ``[B, hidden_size]`` draft hidden states, any float dtype (hidden).
        """
        if self.kind == HIDDEN:
            if hidden is None:
                raise ValueError("this predictor reads the draft hidden state; none was given")
            return hidden.float()
        if topk is None or entropy is None:
            raise ValueError("this predictor reads top-k probabilities and entropy; both are required")
        parts = [topk[..., : self.k].float(), entropy.float().unsqueeze(-1)]
        if self.use_position:
            if position is None:
                raise ValueError("this predictor reads the token position; none was given")
            parts.append(self.encode_position(position).unsqueeze(-1))
        return torch.cat(parts, dim=-1)

    def build_from_probs(self, probs: torch.Tensor, position: torch.Tensor | None = None) -> torch.Tensor:
        """Decode-time helper: ``[B, V]`` draft probabilities -> ``[B, input_dim]``."""
        return self.build(top_k_probs(probs, self.k), _entropy(probs), position)
