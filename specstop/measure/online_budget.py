"""Size an online check to a time budget from the calibrated costs, before any decoding starts.

The online check decodes every method on every prompt, with repeats. At a fixed size it took 6 min
on a 2-core AMX Xeon in bf16 and was on course for 40 min on a 2-core AMD EPYC where ``dtype: auto``
had picked float32: the same config, 7x apart. Sizing it from the cost model makes it fit on any
CPU: each run is priced as its prefill plus ``max_new_tokens`` target-only steps divided by the
method's expected speedup (the replay's, where the eval report has one; 1 otherwise, an upper bound),
and prompts are dropped down to :data:`MIN_PROMPTS` (a check of two prompts set every method's figure
on too few rounds to hold to 10%), then the optional methods (HF's assisted generation with its
defaults, a comparison), then tokens, until the estimate fits. What was chosen is said in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PROMPTS = 4
MIN_TOKENS = 16


@dataclass(frozen=True)
class OnlineSize:
    """What the online check will run, and its estimated seconds.

    Attributes:
        prompts: prompts decoded.
        max_new_tokens: tokens per run.
        repeats: interleaved repeats of every method on every prompt.
        methods: methods decoded (the target alone included).
        estimate_s: estimated wall time from the cost model.
        budget_s: the budget it was sized to (None: not sized).
    """

    prompts: int
    max_new_tokens: int
    repeats: int
    methods: int
    estimate_s: float
    budget_s: float | None

    def line(self) -> str:
        head = (f"online check: {self.prompts} prompts x {self.max_new_tokens} tokens x {self.repeats} repeats x "
                f"{self.methods} methods, about {self.estimate_s:.0f} s (estimated from the cost model")
        if self.budget_s is None:
            return head + ")"
        return head + f"; sized to its {self.budget_s:.0f} s budget)"


def run_seconds(cost, prompt_len: int, max_new_tokens: int, speedup: float = 1.0) -> float:
    """Estimate of one decoding run: the prompt's prefill (priced as t_target(16) per 17 tokens,
    which a single prefill forward does not exceed), then ``max_new_tokens`` target-only steps
    divided by the method's expected ``speedup``."""
    blocks = -(-max(prompt_len - 1, 0) // 17)
    return blocks * cost.target_cost(16) + max_new_tokens * cost.target_cost(0) / max(speedup, 1.0)


def estimate(cost, prompt_lens: list[int], max_new_tokens: int, repeats: int, speedups: list[float]) -> float:
    """Seconds for every method (one expected speedup each; the target alone is 1) on every prompt,
    ``repeats`` times, plus one greedy-check pass of the target per prompt."""
    total = 0.0
    for n in prompt_lens:
        target = run_seconds(cost, n, max_new_tokens)
        total += target + repeats * sum(run_seconds(cost, n, max_new_tokens, s) for s in speedups)
    return total


def size_online_check(cost, prompt_lens: list[int], *, max_new_tokens: int, repeats: int, speedups: list[float],
                      budget_s: float | None, optional: int = 0) -> OnlineSize:
    """The largest check within ``budget_s``: all prompts, methods and tokens if they fit, else fewer
    prompts (down to :data:`MIN_PROMPTS`), then without the ``optional`` methods (the last ones of
    ``speedups``), then fewer tokens (down to :data:`MIN_TOKENS`).

    Args:
        cost: the :class:`~specstop.eval.cost.CostModel` decoding is priced with.
        prompt_lens: token lengths of the candidate prompts, in the order they would be used.
        speedups: each method's expected speedup over the target alone (1.0 where unknown; the
            target alone itself is one of the methods).
        budget_s: seconds for the whole check; None keeps the requested size (and still estimates it).
    """
    n, tokens, methods = len(prompt_lens), max_new_tokens, len(speedups)

    def est(k: int, t: int) -> float:
        return estimate(cost, prompt_lens[:k], t, repeats, speedups[:methods])

    if budget_s is not None:
        while n > MIN_PROMPTS and est(n, tokens) > budget_s:
            n -= 1
        while methods > len(speedups) - optional and est(n, tokens) > budget_s:
            methods -= 1
        while tokens > MIN_TOKENS and est(n, tokens) > budget_s:
            tokens = max(MIN_TOKENS, tokens * 3 // 4)
    return OnlineSize(n, tokens, repeats, methods, est(n, tokens), budget_s)
