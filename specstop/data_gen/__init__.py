"""data_gen: run a real target and draft over prompts and label every draft position.

Modules, one job each:

* ``config``: the ``DataGenConfig`` dataclasses and the strict YAML loader.
* ``batching``: left padding with position ids, per-prompt seeds, inverse-CDF sampling.
* ``responses``: prompt rendering/length checks and the target's batched responses.
* ``forward``: one teacher-forced forward, gathered per response position.
* ``labels``: p_i, q_i and the tokens-table labels (``specstop.probs`` math, float32).
* ``mixing``: SpecDec++ token mixing rows. ``rollouts``: greedy draft rollouts after mismatches.
* ``shard``: one batch -> rows of all four tables. ``runner``: shard plan, resume, workers, manifest.
* ``schema`` / ``storage``: the on-disk contract. ``readback``: flat tensors for training.
* ``cli``: ``specstop generate``.
"""
