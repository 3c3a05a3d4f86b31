"""Tuned settings for the engines people serve with: ``specstop export --for hf|vllm|llamacpp|sglang|trtllm``.

The tuner's rule-based policies map onto knobs these engines already expose:

=========== ==================================================================================
engine      knobs (what each tuned policy becomes)
=========== ==================================================================================
hf          the draft model's ``generation_config``: ``num_assistant_tokens`` +
            ``num_assistant_tokens_schedule`` (static K: constant; heuristic start:
            heuristic_transient) and ``assistant_confidence_threshold`` (confidence tau, with SL_max
            as num_assistant_tokens), applied by :mod:`specstop.decode.hf_settings`; the learned
            predictor itself through ``generate(custom_generate=EXPORT)``.
vllm        ``speculative_config.num_speculative_tokens`` = static K (a fixed draft length, vLLM's own
            draft-model proposer); confidence and learned policies (and with a quantized draft every
            rule) inside that runner, stopped per request (``worker_cls``,
            :mod:`specstop.decode.vllm_worker`); the heuristic through specstop's proposer class
            (``method: custom_class``, :mod:`specstop.decode.vllm_proposer`); set up by
            ``additional_config``.
llamacpp    ``--spec-type draft-simple`` with ``--spec-draft-n-max`` / ``--spec-draft-n-min`` /
            ``--spec-draft-p-min`` (older builds: ``--draft-max`` / ``--draft-min`` /
            ``--draft-p-min``): static K (p-min 0), or SL_max with the confidence threshold as p-min.
sglang      ``--speculative-algorithm STANDALONE`` with ``--speculative-num-steps`` K,
            ``--speculative-eagle-topk 1``, ``--speculative-num-draft-tokens`` K + 1.
trtllm      LLM API ``speculative_config`` (``decoding_type: Draft_Target``, ``max_draft_len`` K,
            ``speculative_model``), written as a ``--extra_llm_api_options`` YAML file.
=========== ==================================================================================

When ``tuned.json`` holds a ``batch_schedule`` (K, or threshold and SL_max, per batch size), each
file also gets ``batch_schedule`` in that engine's own form, with the predicted speedup per batch
size: TensorRT-LLM ``draft_len_schedule``, vLLM ``num_speculative_tokens_per_batch_size``, SGLang
adaptive-speculation tiers (``--speculative-adaptive-config``), llama.cpp one setting per
``--parallel`` (it has no schedule). :func:`validate_engine_file` checks a written file against
the schema each engine documents.

One module per engine (:mod:`~specstop.export.engines.hf`, ``vllm``, ``llamacpp``, ``sglang``,
``trtllm``), each one :class:`~specstop.export.engines.base.Engine`: its settings, schedule, costs and
validation; the shared pricing is :mod:`~specstop.export.engines.pricing`, the tuned schedule's reader
:mod:`~specstop.export.engines.schedule`, and :mod:`~specstop.export.engines.settings` builds and writes
every engine's file the same way.

Every settings file carries the replay's predicted speedup for the policy it encodes and the
cost model (calibration) that prediction assumes, both read from ``tuned.json``: the prediction
holds only on hardware whose step costs match that cost model.
"""

from specstop.export.engines.base import Context, Engine, side_file
from specstop.export.engines.hf import HF_NOTE, hf_policy_usage, hf_usage
from specstop.export.engines.llamacpp import LLAMACPP_DRAFT_TYPE, llamacpp_flags, llamacpp_rule_prediction
from specstop.export.engines.pricing import priced_by
from specstop.export.engines.schedule import BATCH_SCHEDULE_FORMAT, read_batch_schedule
from specstop.export.engines.settings import (
    ENGINES,
    REGISTRY,
    SCHEDULE_ENGINES,
    engine_schedule,
    engine_settings,
    summary_line,
    validate_engine_file,
    write_engine_settings,
)
from specstop.export.engines.sglang import SGLANG_ADAPTIVE_FILE
from specstop.export.engines.trtllm import TRTLLM_DECODING_TYPE, trtllm_options_file
from specstop.export.engines.vllm import (
    RUNNER_PRICED,
    VLLM_PROPOSER_CLASS,
    VLLM_PROPOSER_NOTE,
    VLLM_RUNNER_NOTE,
    VLLM_SETTINGS_KEY,
    VLLM_WORKER_CLASS,
    vllm_proposer_config,
    vllm_runner_config,
)

__all__ = [
    "BATCH_SCHEDULE_FORMAT", "ENGINES", "HF_NOTE", "LLAMACPP_DRAFT_TYPE", "REGISTRY", "RUNNER_PRICED",
    "SCHEDULE_ENGINES", "SGLANG_ADAPTIVE_FILE", "TRTLLM_DECODING_TYPE", "VLLM_PROPOSER_CLASS", "VLLM_PROPOSER_NOTE",
    "VLLM_RUNNER_NOTE", "VLLM_SETTINGS_KEY", "VLLM_WORKER_CLASS", "Context", "Engine", "engine_schedule", "engine_settings", "hf_policy_usage", "hf_usage",
    "llamacpp_flags", "llamacpp_rule_prediction", "priced_by", "read_batch_schedule", "side_file", "summary_line",
    "trtllm_options_file", "validate_engine_file", "vllm_proposer_config", "vllm_runner_config", "write_engine_settings",
]
