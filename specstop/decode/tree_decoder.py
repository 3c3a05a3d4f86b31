"""A lossless multi-candidate (token tree) speculative decoder: ``mcsd:K1,K2,...`` and ``tree:N``.

Round semantics are the chain decoder's (:mod:`specstop.export.decoder`, docs/design.md), with a tree
in place of the chain:

1. ``depth_cap = min(shape depth, remaining - 1)``; ``depth_cap == 0`` -> one target step, no draft.
2. The draft grows a token tree below the last token (:mod:`specstop.decode.drafting`): the
   catch-up feed gives q at the root, then each step feeds all nodes it expands in one forward
   with tree attention.
3. One target forward over the whole tree (:mod:`specstop.decode.tree_cache`) gives p at every
   node; :mod:`specstop.decode.verify` accepts a root-to-node path (greedy: the longest path of
   target argmaxes; sampling: MCSD's multi-candidate rejection sampling) and emits one more token
   from the target. Emitting EOS ends the response.
4. Both KV caches keep only the accepted path (gathered into a contiguous prefix).

Counters follow the chain decoder: ``N`` emitted tokens, ``N_target`` target forwards, ``N_draft``
drafted tree nodes (all verified), ``N_discarded`` those not on the accepted path, plus
``draft_forwards`` (tree forwards, the catch-up feed excluded). ``round_lengths`` lists the tree
size K per round, ``accepted_per_round`` the accepted depth n. Batch size 1, DynamicCache only.
"""

from __future__ import annotations

from typing import Any

import torch

from specstop.decode.drafting import grow_tree
from specstop.decode.tree_cache import TreeLM
from specstop.decode.tree_shape import DynamicTreeShape, TreeShape
from specstop.decode.verify import greedy_walk, sampling_walk
from specstop.errors import UserError
from specstop.export.decoder import DecodeResult, _Timer, eos_token_ids
from specstop.probs import DecodingConfig, logits_to_probs

__all__ = ["TreeDecoder"]


def _chain_parents(n: int) -> list[int]:
    """Region parents of ``n`` plain sequence tokens fed in order (each follows the previous one)."""
    return list(range(-1, n - 1))


class TreeDecoder:
    """Token-tree speculative decoding of one prompt at a time.

    Args:
        pair: the draft/target :class:`~specstop.pair.ModelPair` (attention ``eager`` or ``sdpa``).
        shape: a :class:`~specstop.decode.tree_shape.StaticTreeShape` or ``DynamicTreeShape``
            (:func:`~specstop.decode.tree_shape.parse_tree_policy` builds one from ``mcsd:``/``tree:``).
        decoding: the decoding transform for both models (temperature 0 = greedy).
        node_head: a :class:`~specstop.decode.node_head.NodeHeadScorer` that decides which nodes a
            dynamic tree drafts (None: the joint draft probability); verification is unchanged.
    """

    def __init__(self, pair, shape: TreeShape, decoding: DecodingConfig | None = None, node_head=None) -> None:
        if node_head is not None and not isinstance(shape, DynamicTreeShape):
            raise UserError(
                f"a node head steers dynamic trees (tree:N); {shape.label} has a fixed shape - use tree:N "
                "or drop the node head"
            )
        self.pair = pair
        self.shape = shape
        self.node_head = node_head
        self.decoding = decoding or DecodingConfig()
        self.vocab_size = pair.vocab_size
        self.eos = eos_token_ids(pair)
        self.last_state: dict[str, Any] | None = None  # caches + sequence of the last run (tests inspect it)

    @property
    def label(self) -> str:
        return self.shape.label + ("+node-head" if self.node_head is not None else "")

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.decoding, self.vocab_size)

    def _expander(self, draft: TreeLM, slot: dict[int, int]):
        """``expand(tree, nodes)`` for :func:`grow_tree`: one draft forward over ``nodes`` with tree
        attention; records each fed node's region slot in ``slot`` (node -> slot)."""

        def expand(tree, nodes: list[int]) -> torch.Tensor:
            base = len(draft.region_parents)
            parents = [slot[tree.parents[u]] for u in nodes]
            logits = draft.feed_nodes([tree.tokens[u] for u in nodes], parents)
            slot.update((u, base + i) for i, u in enumerate(nodes))
            return self._probs(logits)

        return expand

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None, *, max_draft: int | None = None
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (batch size 1).

        Args:
            prompt_ids: the rendered prompt's token ids (non-empty).
            max_new_tokens: length cap; the response never exceeds it.
            seed: seeds the candidate draws, the acceptance uniforms and the final samples (sampling only).
            max_draft: cap the tree depth every round (0: plain target decoding through the same loop).
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: give at least one token (e.g. the chat template's header)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        greedy = self.decoding.greedy
        draft, target = TreeLM(self.pair.draft), TreeLM(self.pair.target)
        timer = _Timer(target.device)
        gen = None
        if not greedy:
            gen = torch.Generator(device=draft.device)
            gen.manual_seed(0 if seed is None else int(seed))

        seq = list(prompt_ids)
        out: list[int] = []
        rounds_k: list[int] = []
        rounds_n: list[int] = []
        round_seconds: list[float] = []
        n_target = n_draft = n_discarded = draft_forwards = 0
        stop_reason = "length"
        t_start = timer.now()

        if len(seq) > 1:  # prefill all but the last prompt token; it is fed with the first round
            t0 = timer.now()
            draft.feed(seq[:-1], keep_logits=1)
            t0 = timer.add("prefill", t0)
            target.feed(seq[:-1], keep_logits=1)
            timer.add("prefill", t0)

        while len(out) < max_new_tokens:
            remaining = max_new_tokens - len(out)
            depth_cap = min(self.shape.max_depth, remaining - 1)
            if max_draft is not None:
                depth_cap = min(depth_cap, max_draft)
            t_round = timer.now()
            if depth_cap <= 0:
                logits, _ = target.feed(seq[target.length :], keep_logits=1)
                row = logits[-1]
                if greedy:
                    tok = int(row[: self.vocab_size].argmax())
                else:
                    tok = int(torch.multinomial(self._probs(row).to(gen.device), 1, generator=gen))
                round_seconds.append(timer.add("target", t_round) - t_round)
                n_target += 1
                rounds_k.append(0)
                rounds_n.append(0)
                seq.append(tok)
                out.append(tok)
                if tok in self.eos:
                    stop_reason = "eos"
                    break
                continue

            # ---- draft: catch-up feed (q at the root), then the tree
            draft.start_region()
            pending = seq[draft.length :]
            root_logits = draft.feed_nodes(pending, _chain_parents(len(pending)), keep_logits=1)
            slot = {0: len(pending) - 1}  # tree node -> draft region slot
            tree, forwards = grow_tree(
                self.shape, seq[-1], self._probs(root_logits[-1]), self._expander(draft, slot),
                depth_cap=depth_cap, eos=self.eos, greedy=greedy, gen=gen, scorer=self.node_head,
            )
            t0 = timer.add("draft", t_round)

            # ---- verify: the target's pending tokens then every tree node, one forward
            target.start_region()
            t_pending = seq[target.length :]
            m = len(t_pending)
            parents = _chain_parents(m) + [m - 1 + p for p in tree.parents[1:]]
            k = tree.num_drafted
            logits = target.feed_nodes(t_pending + tree.tokens[1:], parents, keep_logits=k + 1)  # root, nodes
            t0 = timer.add("target", t0)
            if greedy:
                path, final = greedy_walk(tree, logits[:, : self.vocab_size].argmax(-1).tolist(), self.eos)
            else:
                path, final = sampling_walk(tree, self._probs(logits), gen, self.eos)
            t0 = timer.add("accept", t0)

            # ---- keep the accepted path in both caches
            n = len(path)
            emitted = [tree.tokens[u] for u in path] + ([] if final is None else [final])
            target.keep_path(list(range(m)) + [m - 1 + u for u in path])
            draft.keep_path(list(range(len(pending))) + [slot[u] for u in path if u in slot])
            n_target += 1
            n_draft += k
            n_discarded += k - n
            draft_forwards += forwards
            rounds_k.append(k)
            rounds_n.append(n)
            seq.extend(emitted)
            out.extend(emitted)
            round_seconds.append(timer.add("rollback", t0) - t_round)
            if out[-1] in self.eos:
                stop_reason = "eos"
                break

        total = timer.now() - t_start
        self.last_state = {"seq": seq, "draft": draft, "target": target}
        counters = {
            "N": len(out),
            "N_target": n_target,
            "N_draft": n_draft,
            "N_discarded": n_discarded,
            "draft_forwards": draft_forwards,
            "rounds": len(rounds_k),
            "stop_reason": stop_reason,
            "policy": self.label,
            "batch_size": 1,
        }
        timings: dict[str, Any] = dict(timer.totals)
        timings["total"] = total
        timings["round_seconds"] = round_seconds
        text = self.pair.tokenizer.decode(out, skip_special_tokens=True)
        return DecodeResult(out, text, counters, rounds_k, rounds_n, timings)
