"""``specstop pipeline``: pair -> data -> train -> tune -> eval -> export -> online check, resumable.

Every stage runs through the same public CLI a user would type (``specstop generate``, ``specstop
train`` ...), so the pipeline cannot drift from the individual commands, and every stage's exact
command line is recorded in the run folder. Stages are skipped when their configuration and the
stages they read are unchanged (see :mod:`specstop.pipeline.stages`).

Run folder::

    RUN/configs/            the generated per-stage configs
    RUN/data/               dataset (train/validation/test)       RUN/test_data/  optional transfer set
    RUN/train/<family>/     Lightning logs, best checkpoint, metrics.json
    RUN/cost.json           cost model (when calibrated)
    RUN/tuned.json          tuned policies (validation split)
    RUN/eval/               replay report (report.md/json, plots)
    RUN/export/             the exported best policy
    RUN/online.json         short online check with the decoder
    RUN/report.md, RUN/report.json

Modules: ``config`` (the YAML schema), ``stages`` (skip/rerun bookkeeping), ``run`` (the stage
order), ``online_check`` (the closing real-decoding check), ``report`` (report.md/json), ``cli``;
``sweep`` is `specstop sweep` (a grid of trainings, tabulated).
"""

from specstop.pipeline.config import FamilySpec, PipelineConfig

__all__ = ["FamilySpec", "PipelineConfig", "run_pipeline"]


def run_pipeline(cfg: PipelineConfig, *, force: bool = False) -> dict:
    """Run (or resume) the pipeline; see :func:`specstop.pipeline.run.run_pipeline`."""
    from specstop.pipeline.run import run_pipeline as run

    return run(cfg, force=force)
