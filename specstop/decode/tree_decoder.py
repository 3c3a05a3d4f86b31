"""A lossless multi-candidate (token tree) speculative decoder: ``mcsd:K1,K2,...`` and ``tree:N``.

Round semantics are the chain decoder's (:mod:`specstop.decode.chain`, docs/design.md), with a tree
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
``draft_forwards`` (tree forwards, the catch-up feed excluded) and ``draft_width_hist`` (index W:
draft forwards that fed W nodes, catch-up feeds included). ``round_lengths`` lists the tree
size K per round, ``accepted_per_round`` the accepted depth n. Batch size 1, DynamicCache only.
"""

from __future__ import annotations

from typing import Any

import torch

from specstop.decode.chain import DecodeResult, _Timer, eos_token_ids
from specstop.decode.drafting import candidate_order, grow_below, grow_tree
from specstop.decode.token_tree import TokenTree
from specstop.decode.tree_cache import TreeLM
from specstop.decode.verify import greedy_walk, sampling_walk
from specstop.errors import UserError
from specstop.pair.context import check_request, check_seed
from specstop.probs import DecodingConfig, logits_to_probs
from specstop.tree_policy import DynamicTreeShape, StaticTreeShape, TreeShape

__all__ = ["TreeDecoder"]


def _chain_parents(n: int) -> list[int]:
    """Region parents of ``n`` plain sequence tokens fed in order (each follows the previous one)."""
    return list(range(-1, n - 1))


class TreeDecoder:
    """Token-tree speculative decoding of one prompt at a time.

    Args:
        pair: the draft/target :class:`~specstop.pair.ModelPair` (attention ``eager`` or ``sdpa``).
        shape: a :class:`~specstop.tree_policy.StaticTreeShape` or ``DynamicTreeShape``
            (:func:`~specstop.tree_policy.parse_tree_policy` builds one from ``mcsd:``/``tree:``).
        decoding: the decoding transform for both models (temperature 0 = greedy).
        node_head: a :class:`~specstop.decode.node_head.NodeHeadScorer` that decides which nodes a
            dynamic tree drafts (None: the joint draft probability); verification is unchanged.
        target_init: T >= 1 turns on improved MCSD's target-initialized multi-candidate generation
            (section 3.1) for a static shape: NOT lossless for T >= 2 (see :meth:`_generate_target_init`).
    """

    def __init__(self, pair, shape: TreeShape, decoding: DecodingConfig | None = None, node_head=None,
                 target_init: int | None = None) -> None:
        if node_head is not None and not isinstance(shape, DynamicTreeShape):
            raise UserError(
                f"a node head steers dynamic trees (tree:N); {shape.label} has a fixed shape - use tree:N "
                "or drop the node head"
            )
        if target_init is not None:
            if not isinstance(shape, StaticTreeShape):
                raise UserError(f"target-initialized generation grows a static k-config below the target's tokens; "
                                f"{shape.label} is not one - use mcsd:K1,K2,...")
            if int(target_init) < 1:
                raise UserError(f"target-initialized generation needs T >= 1 target tokens per round, got {target_init}")
            if int(target_init) > pair.vocab_size:
                # More first-level tokens than the vocabulary holds cannot be drawn: T would be silently cut.
                raise UserError(f"target-initialized generation (--target-init T) draws T distinct target tokens per round, but the "
                                f"vocabulary has {pair.vocab_size}: give T <= {pair.vocab_size} (got {target_init})")
        self.target_init = None if target_init is None else int(target_init)
        self.pair = pair
        self.shape = shape
        self.node_head = node_head
        self.decoding = decoding or DecodingConfig()
        self.vocab_size = pair.vocab_size
        self.eos = eos_token_ids(pair)
        self.last_state: dict[str, Any] | None = None  # caches + sequence of the last run (tests inspect it)

    @property
    def label(self) -> str:
        return (self.shape.label + ("+node-head" if self.node_head is not None else "")
                + (f"+target-init:{self.target_init}" if self.target_init is not None else ""))

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.decoding, self.vocab_size)

    def _expander(self, draft: TreeLM, slot: dict[int, int], widths: list[int]):
        """``expand(tree, nodes)`` for :func:`grow_tree`: one draft forward over ``nodes`` with tree
        attention; records each fed node's region slot in ``slot`` (node -> slot) and the forward's
        width in ``widths``."""

        def expand(tree, nodes: list[int]) -> torch.Tensor:
            widths.append(len(nodes))
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
        prompt_ids = check_request(self.pair, prompt_ids, max_new_tokens)
        seed = check_seed(seed)
        if self.target_init is not None:
            return self._generate_target_init(prompt_ids, max_new_tokens, seed, max_draft)
        greedy = self.decoding.greedy
        draft, target, timer, gen = self._start(seed)

        seq = list(prompt_ids)
        out: list[int] = []
        rounds_k: list[int] = []
        rounds_n: list[int] = []
        round_seconds: list[float] = []
        n_target = n_draft = n_discarded = draft_forwards = 0
        widths: list[int] = []  # nodes fed per draft forward (catch-up feeds included): how cost models price them
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
            widths.append(len(pending))
            slot = {0: len(pending) - 1}  # tree node -> draft region slot
            tree, forwards = grow_tree(
                self.shape, seq[-1], self._probs(root_logits[-1]), self._expander(draft, slot, widths),
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

        self.last_state = {"seq": seq, "draft": draft, "target": target}
        return self._result(out, timer, t_start, round_seconds, rounds_k, rounds_n, widths, {
            "N_target": n_target, "N_draft": n_draft, "N_discarded": n_discarded, "draft_forwards": draft_forwards,
            "stop_reason": stop_reason})

    def _start(self, seed: int | None):
        """``(draft, target, phase timer, sampling generator or None)`` for one run."""
        draft, target = TreeLM(self.pair.draft), TreeLM(self.pair.target)
        gen = None
        if not self.decoding.greedy:
            gen = torch.Generator(device=draft.device)
            gen.manual_seed(0 if seed is None else int(seed))
        return draft, target, _Timer(target.device), gen

    def _result(self, out: list[int], timer, t_start: float, round_seconds: list[float], rounds_k: list[int],
                rounds_n: list[int], widths: list[int], tallies: dict[str, Any]) -> DecodeResult:
        """The :class:`DecodeResult` of a finished run: counters in the chain decoder's names (``tallies``
        carries the run's own, e.g. ``N_target``, ``stop_reason``), timings per phase and per round."""
        total = timer.now() - t_start
        counters = {
            "N": len(out),
            **tallies,
            "draft_width_hist": [widths.count(w) for w in range(max(widths, default=0) + 1)],
            "rounds": len(rounds_k),
            "policy": self.label,
            "batch_size": 1,
        }
        timings: dict[str, Any] = dict(timer.totals)
        timings["total"] = total
        timings["round_seconds"] = round_seconds
        text = self.pair.tokenizer.decode(out, skip_special_tokens=True)
        return DecodeResult(out, text, counters, rounds_k, rounds_n, timings)

    @torch.no_grad()
    def _generate_target_init(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int | None, max_draft: int | None
    ) -> DecodeResult:
        """Improved MCSD's target-initialized multi-candidate generation (Lu et al., section 3.1).

        NOT lossless for T >= 2. Each round starts from the target's distribution p after the last
        emitted token (the prompt's goes through the target at prefill). The target's T tokens t_1..t_T
        are drawn from p (greedy: its top T; sampling: T draws without replacement, from the last
        residual of the previous round's walk) and become the tree's first level; the draft grows the
        static k-config below each of them (config (T, K1, K2, ...) = ``mcsd:K1,K2,...`` with T). One
        target forward verifies all of it; below each t_j the chain decoder's walk (greedy or MCSD's
        multi-candidate rule) accepts a path, and the t_j with the LONGEST accepted path is emitted
        with it (ties: the earliest t_j). Picking t_j by what follows it gives P_output(t) =
        P_target(t) x P_acceptance(t+1, ... | t) (the paper's equation): the output is no longer the
        target's. T = 1 keeps it (t_1 is the target's own token).

        Counters as :meth:`generate`: ``round_lengths`` counts the verified nodes (the T target tokens
        included), ``accepted_per_round`` the emitted tokens minus one, ``N_draft`` the drafted nodes and
        ``N_discarded`` the drafted nodes not emitted (the target's own tokens are neither: at most
        ``N_draft`` are discarded).
        """
        greedy = self.decoding.greedy
        n_init = self.target_init
        draft, target, timer, gen = self._start(seed)
        seq = list(prompt_ids)
        out: list[int] = []
        rounds_k: list[int] = []
        rounds_n: list[int] = []
        round_seconds: list[float] = []
        widths: list[int] = []
        n_target = n_draft = n_discarded = draft_forwards = 0
        stop_reason = "length"
        t_start = timer.now()

        t0 = timer.now()
        if len(seq) > 1:  # the draft gets the last prompt token with the first round's candidates
            draft.feed(seq[:-1], keep_logits=1)
        t0 = timer.add("prefill", t0)
        logits, _ = target.feed(seq, keep_logits=1)  # the prompt goes through the target: p after it
        timer.add("prefill", t0)
        p_root = self._probs(logits[-1])

        while len(out) < max_new_tokens:
            t_round = timer.now()
            remaining = max_new_tokens - len(out)
            below = min(self.shape.max_depth, remaining - 1)  # drafted levels below the target's tokens
            if max_draft is not None:
                below = min(below, max_draft)
            cands, _ = candidate_order(p_root, n_init if below > 0 else 1, greedy, gen)
            if remaining == 1:  # the last token: the target's first candidate, no forward needed
                seq.append(cands[0])
                out.append(cands[0])
                rounds_k.append(0)
                rounds_n.append(0)
                round_seconds.append(timer.now() - t_round)
                stop_reason = "eos" if cands[0] in self.eos else stop_reason
                break

            # ---- draft: the pending tokens and the live candidates in one forward, then the k-config below
            tree = TokenTree.rooted_at(seq[-1])
            first = [tree.add(0, c, 1.0) for c in cands]
            live = [u for u in first if tree.tokens[u] not in self.eos] if below > 0 else []
            draft.start_region()
            pending = seq[draft.length :]
            slot: dict[int, int] = {}
            fed_pending, forwards = 0, 0
            if live:
                m_d = len(pending)
                d_logits = draft.feed_nodes(pending + [tree.tokens[u] for u in live],
                                            _chain_parents(m_d) + [m_d - 1] * len(live), keep_logits=len(live))
                widths.append(m_d + len(live))
                fed_pending = m_d
                slot.update((u, m_d + i) for i, u in enumerate(live))
                for u, q in zip(live, self._probs(d_logits)):
                    tree.draft_dists[u] = q
                forwards = 1 + grow_below(self.shape, tree, live, self._expander(draft, slot, widths), depth_cap=below,
                                          eos=self.eos, greedy=greedy, gen=gen)
            t0 = timer.add("draft", t_round)

            # ---- verify every node in one target forward (node u's row is u - 1)
            target.start_region()
            t_pending = seq[target.length :]
            m = len(t_pending)
            k = tree.num_drafted
            parents = _chain_parents(m) + [m - 1 + p for p in tree.parents[1:]]
            logits = target.feed_nodes(t_pending + tree.tokens[1:], parents, keep_logits=k)
            t0 = timer.add("target", t0)
            rows = torch.cat([torch.zeros_like(logits[:1]), logits])  # row u = node u (the root's is unused)
            probs = self._probs(rows)
            walks = []
            for u in first:
                if greedy:
                    path, _ = greedy_walk(tree, rows[:, : self.vocab_size].argmax(-1).tolist(), self.eos, start=u)
                    end = u if not path else path[-1]
                    walks.append((path, probs[end]))
                else:
                    walks.append(sampling_walk(tree, probs, gen, self.eos, start=u, sample_final=False))
            best = max(range(len(first)), key=lambda j: (len(walks[j][0]), -j))  # longest path, then earliest
            path = [first[best]] + walks[best][0]
            p_root = walks[best][1]
            t0 = timer.add("accept", t0)

            # ---- keep the emitted path in both caches
            emitted = [tree.tokens[u] for u in path]
            target.keep_path(list(range(m)) + [m - 1 + u for u in path])
            draft.keep_path(list(range(fed_pending)) + [slot[u] for u in path if u in slot])
            n_target += 1
            n_draft += k - len(first)
            n_discarded += (k - len(first)) - (len(path) - 1)  # path[0] is the target's token, not drafted
            draft_forwards += forwards
            rounds_k.append(k)
            rounds_n.append(len(path) - 1)
            seq.extend(emitted)
            out.extend(emitted)
            round_seconds.append(timer.add("rollback", t0) - t_round)
            if emitted[-1] in self.eos:
                stop_reason = "eos"
                break

        self.last_state = {"seq": seq, "draft": draft, "target": target}
        return self._result(out, timer, t_start, round_seconds, rounds_k, rounds_n, widths, {
            "N_target": n_target, "N_draft": n_draft, "N_discarded": n_discarded, "draft_forwards": draft_forwards,
            "stop_reason": stop_reason, "lossless": self.target_init == 1})
