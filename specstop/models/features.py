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
        hidden_size: draft hidden width (hidden, or dist with ``with_state``).
        hidden_layer: which draft layer's output (-1 = final, after the final norm).
        with_state: (dist only) also read the draft state that *produced* q_i - the final hidden
            state after the token before it, which the same draft forward returns with q_i - so the
            predictor judges the current token from the distribution and the state behind it. (A
            specstop extension: DISCO reads q_i only; SpecDec++ reads the state after the token,
            one step late.) At response position 0 that state follows the prompt, which datasets do
            not store, so it is zeroed there in training, replay and decoding alike.
    """

    kind: str
    k: int = 10
    use_position: bool = False
    position_scale: float = 1024.0
    hidden_size: int = 0
    hidden_layer: int = -1
    with_state: bool = False

    def __post_init__(self) -> None:
        if self.kind not in (DIST, HIDDEN):
            raise UserError(f"feature kind must be {DIST!r} or {HIDDEN!r}, got {self.kind!r}")
        if self.kind == HIDDEN and self.hidden_size <= 0:
            raise UserError("a hidden-state predictor needs hidden_size > 0 (the draft's hidden width)")
        if self.with_state and (self.kind != DIST or self.hidden_size <= 0):
            raise UserError("with_state needs a dist predictor and hidden_size > 0 (a dataset with hidden states)")

    @property
    def input_dim(self) -> int:
        if self.kind == HIDDEN:
            return self.hidden_size
        return self.k + 1 + int(self.use_position) + (self.hidden_size if self.with_state else 0)

    @property
    def reads_hidden(self) -> bool:
        """Reads the state *after* the drafted token (scores token j - 1 at step j): SpecDec++ style."""
        return self.kind == HIDDEN

    @property
    def reads_state(self) -> bool:
        """Reads the state that produced q_j alongside q_j (scores token j at step j)."""
        return self.with_state

    @property
    def needs_hidden(self) -> bool:
        """Any hidden state at all (datasets must store them, decoders must request them)."""
        return self.reads_hidden or self.reads_state

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
            position: ``[B]`` 0-based response positions (dist with use_position or with_state).
            hidden: ``[B, hidden_size]`` draft hidden states, any float dtype: the state after the
                token (hidden), or the state that produced q (dist with_state).
        """
        if self.kind == HIDDEN:
            if hidden is None:
                raise ValueError("this predictor reads the draft hidden state; none was given")
            return hidden.float()
        if topk is None or entropy is None:
            raise ValueError("this predictor reads top-k probabilities and entropy; both are required")
        parts = [topk[..., : self.k].float(), entropy.float().unsqueeze(-1)]
        if (self.use_position or self.with_state) and position is None:
            raise ValueError("this predictor reads the token position; none was given")
        if self.use_position:
            parts.append(self.encode_position(position).unsqueeze(-1))
        if self.with_state:
            if hidden is None:
                raise ValueError("this predictor reads the draft state that produced q; none was given")
            # Position 0's state (after the prompt) is not in datasets: zero everywhere alike.
            parts.append(hidden.float() * (torch.as_tensor(position) > 0).unsqueeze(-1).to(parts[0].device))
        return torch.cat(parts, dim=-1)

    def build_from_probs(self, probs: torch.Tensor, position: torch.Tensor | None = None,
                         state: torch.Tensor | None = None) -> torch.Tensor:
        """Decode-time helper: ``[B, V]`` draft probabilities (and ``[B, H]`` producing states for
        ``with_state``) -> ``[B, input_dim]``."""
        return self.build(top_k_probs(probs, self.k), _entropy(probs), position, state)
