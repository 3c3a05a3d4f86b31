"""Tree shapes: how many candidates a round drafts, and where (the ``mcsd:`` and ``tree:`` policies).

Like :mod:`specstop.policy` for chains, shared by replay and tuning (:mod:`specstop.eval.tree_tune`),
exports and the tree decoder (:mod:`specstop.decode`); plain Python.

- :class:`StaticTreeShape` - MCSD's k-config: ``mcsd:4,2,2,1`` gives the root 4 children, each of
  them 2, each of those 2, and each of those 1 (4 + 8 + 16 + 16 = 44 nodes, depth 4). Improved
  MCSD's fork of width W and depth D is ``mcsd:W,1,1,...`` (D numbers).
- :class:`DynamicTreeShape` - ``tree:N[,W[,D]]``: a best-first tree of N nodes grown in steps of at
  most W nodes (one draft forward per step) up to depth D, always adding the candidate children with
  the highest estimated path acceptance (EAGLE-2's rule; see :mod:`specstop.decode.drafting`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specstop.errors import UserError

__all__ = ["MAX_TREE_NODES", "DynamicTreeShape", "StaticTreeShape", "TreeShape", "parse_tree_policy"]

# One target forward verifies the whole tree; beyond this the forward is no longer "about one step".
MAX_TREE_NODES = 1024


@dataclass(frozen=True)
class StaticTreeShape:
    """MCSD k-config: ``branching[d]`` children for every node at depth d (root = depth 0)."""

    branching: tuple[int, ...]

    @property
    def label(self) -> str:
        return "mcsd:" + ",".join(map(str, self.branching))

    @property
    def max_depth(self) -> int:
        return len(self.branching)

    @property
    def max_nodes(self) -> int:
        total, level = 0, 1
        for k in self.branching:
            level *= k
            total += level
        return total


@dataclass(frozen=True)
class DynamicTreeShape:
    """A best-first tree: ``budget`` nodes, at most ``width`` added per draft forward, depth <= ``max_depth``."""

    budget: int
    width: int
    max_depth: int

    @classmethod
    def with_defaults(cls, budget: int, width: int | None = None, max_depth: int | None = None) -> DynamicTreeShape:
        """Default width ``ceil(N / 4)`` (about four draft forwards a round, like ``static:4``) and depth N."""
        return cls(budget, width or max(1, math.ceil(budget / 4)), max_depth or budget)

    @property
    def label(self) -> str:
        return f"tree:{self.budget},{self.width},{self.max_depth}"

    @property
    def max_nodes(self) -> int:
        return self.budget


TreeShape = StaticTreeShape | DynamicTreeShape

_FORMS = "mcsd:K1,K2,... (e.g. mcsd:4,2,2,1) or tree:N[,WIDTH[,DEPTH]] (e.g. tree:16)"


def _ints(text: str, what: str) -> list[int]:
    parts = [p.strip() for p in what.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise UserError(f"policy {text!r}: expected comma-separated whole numbers, got {what!r}; use {_FORMS}") from None
    if any(v < 1 for v in values):
        raise UserError(f"policy {text!r}: every number must be >= 1, got {what!r}; use {_FORMS}")
    return values


def parse_tree_policy(text: str) -> TreeShape | None:
    """Parse ``mcsd:K1,K2,...`` / ``tree:N[,W[,D]]``; None for any other policy text (chain policies).

    Raises:
        UserError: a malformed tree spec, in one line naming the fix.
    """
    name, sep, arg = str(text).strip().partition(":")
    if name not in ("mcsd", "tree"):
        return None
    if not sep or not arg.strip():
        raise UserError(f"policy {text!r} needs its numbers: use {_FORMS}")
    values = _ints(text, arg)
    if name == "mcsd":
        shape: TreeShape = StaticTreeShape(tuple(values))
    else:
        if len(values) > 3:
            raise UserError(f"policy {text!r}: tree:N takes at most N, WIDTH and DEPTH; use {_FORMS}")
        shape = DynamicTreeShape.with_defaults(*values)
        if shape.width > shape.budget:
            raise UserError(f"policy {text!r}: WIDTH {shape.width} exceeds the node budget N={shape.budget}")
    if shape.max_nodes > MAX_TREE_NODES:
        raise UserError(
            f"policy {text!r} drafts {shape.max_nodes} tree nodes; at most {MAX_TREE_NODES} fit one target "
            "forward - use fewer or smaller numbers"
        )
    return shape
