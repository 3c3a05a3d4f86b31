"""PEARL (Liu et al., sections 3-4) as a timing-model baseline on greedy replay data.

PEARL runs the draft and the target *in parallel* with window gamma = round(t_target / t_draft)
(its Theorem 1: the draft then produces gamma tokens in the time of one target pass). Two modes:

* **pre-verify** (drafting phase, at prefix s): the draft drafts gamma tokens y_s..y_{s+g-1}
  while the target runs one pass on the prefix and so verifies y_s.
  Phase time = max(g * t_draft, t_target(1)). If y_s is rejected, the target's token X_s is
  emitted (1 token), the drafts are dropped and the next phase is pre-verify at s + 1. If y_s is
  accepted the block goes to post-verify.
* **post-verify** (verification phase, block y_s..y_{s+g-1} with y_s already verified): the target
  verifies the block while the draft, assuming all are accepted, drafts the next gamma tokens.
  Phase time = max(t_target(g), gamma * t_draft). With n leading matches: if n < g, emit n tokens
  plus the target's correction and return to pre-verify at s + n + 1 (the parallel drafts are
  dropped); if n = g, the target's last logit verifies the first new draft token: accepted ->
  emit g, stay in post-verify with the new block; rejected -> emit g + the correction, pre-verify.

A target pass over n tokens costs the cost model's t_target(n - 1) (its per-K table). Greedy data decide every
acceptance (greedy_match along the response); tokens after a mismatch are dropped anyway, so
rollouts are not needed. Caps as in design.md: blocks never exceed remaining - 1 tokens (or the
recorded response when it ends with EOS); a block of 0 is a plain target step.

This is a timing model, not a measurement. With a cost model calibrated with the split
(``CostModel.pearl_split``: ``specstop calibrate-cost`` times each model on its share of the cores,
beside the other, as :class:`~specstop.decode.pearl.PearlDecoder` runs them) the draft step and the
target passes are priced as measured there; without one, both models are priced at their whole-machine
speed, i.e. perfect overlap with no contention, which is optimistic wherever the two share a machine.
Synchronisation between the two workers is not priced either way.
"""

from __future__ import annotations

import numpy as np

from specstop.eval.cost import CostModel
from specstop.eval.episodes import ReplayData


def pearl_gamma(cost: CostModel) -> int:
    """PEARL's optimal window: round(t_target / t_draft), at least 1."""
    return max(1, int(round(cost.single_step / max(cost.draft_step, 1e-12))))


def match_runs(data: ReplayData) -> np.ndarray:
    """[T] number of consecutive greedy matches starting at each row (within its prompt)."""
    t = data.num_tokens
    run = np.zeros(t + 1, dtype=np.int64)
    gm = data.greedy_match
    ends = np.zeros(t + 1, dtype=bool)
    ends[data.offsets[1:]] = True
    for i in range(t - 1, -1, -1):  # O(T); replay-only baseline
        run[i] = 0 if not gm[i] else (1 if ends[i + 1] else run[i + 1] + 1)
    return run[:t]


def pearl_replay(data: ReplayData, cost: CostModel, gamma: int | None = None) -> dict:
    """Replay PEARL's timing model on every prompt; returns report metrics (latency per token etc.)."""
    g0 = gamma or pearl_gamma(cost)
    run = match_runs(data)
    total_time = 0.0
    phases = drafted = accepted = emitted_all = 0
    split = cost.pearl_split
    td = split["draft_step"] if split else cost.draft_step  # PEARL has no stopping predictor
    scale = split["target_scale"] if split else 1.0

    t_by_k = cost.target_costs(max(g0, 1))

    def tt(n: int) -> float:
        """One target pass over n tokens (K = n - 1 in the cost model's table), on its share."""
        return scale * (float(t_by_k[n - 1]) if n - 1 < len(t_by_k) else cost.target_cost(n - 1))

    for p in range(data.num_prompts):
        o, n_tok = int(data.offsets[p]), int(data.offsets[p + 1] - data.offsets[p])
        ends_eos = n_tok > 0 and bool(data.is_eos(data.token[o + n_tok - 1]))
        s, mode, g = 0, "pre", 0
        while s < n_tok:
            rem = data.max_new_tokens - s
            gmax = min(g0, rem - 1, n_tok - s if ends_eos else rem - 1)
            if mode == "pre":
                if gmax <= 0:
                    total_time += tt(1)
                    phases += 1
                    s += 1
                    emitted_all += 1
                    continue
                total_time += max(gmax * td, tt(1))
                phases += 1
                drafted += gmax
                if not data.greedy_match[o + s]:
                    s += 1
                    emitted_all += 1
                    continue
                mode, g = "post", gmax
                continue
            # post-verify: block s..s+g-1, first token already verified.
            nxt = min(g0, max(0, data.max_new_tokens - (s + g) - 1))
            total_time += max(tt(g), g0 * td)
            phases += 1
            drafted += nxt
            n = min(int(run[o + s]), g)
            if n < g:
                accepted += n
                s += n + 1
                emitted_all += n + 1
                mode = "pre"
                continue
            accepted += g
            if ends_eos and s + g >= n_tok:  # the block ended with the accepted EOS
                s += g
                emitted_all += g
                break
            if nxt == 0 or s + g >= n_tok:  # the last logit supplies the final token
                s += g + 1
                emitted_all += g + 1
                mode = "pre"
                continue
            if data.greedy_match[o + s + g]:
                s += g
                emitted_all += g
                gl = min(
                    g0, data.max_new_tokens - s - 1, n_tok - s if ends_eos else data.max_new_tokens - s - 1
                )
                g = max(1, gl)
                continue
            s += g + 1
            emitted_all += g + 1
            mode = "pre"
    n = max(emitted_all, 1)
    lat = total_time / n
    return {
        "n": emitted_all,
        "n_target": phases,
        "n_draft": drafted,
        "n_accepted": accepted,
        "n_discarded": drafted - accepted,
        "prompts": data.num_prompts,
        "verification_rate": phases / n,
        "discard_rate": (drafted - accepted) / n,
        "accepted_per_round": accepted / max(phases, 1),
        "tokens_per_round": emitted_all / max(phases, 1),
        "latency_per_token": lat,
        "speedup": cost.target_only_per_token / lat,
        "gamma": g0,
        "model": "PEARL timing model (parallel draft/target, pre-/post-verify), see specstop/eval/pearl.py; "
        + ("priced with the measured core split (each model on its share, beside the other)" if split
           else "idealised: both models at whole-machine speed, perfect overlap"),
    }
