"""prompts: prompt sources (hub ids, JSON/JSONL files, HumanEval), the papers' templates, splits."""

from specstop.prompts.sources import (
    PromptRecord,
    PromptSetConfig,
    humaneval_path,
    load_prompt_set,
    load_records,
    render_prompt,
)
from specstop.prompts.splits import DISCO_SIZES, MBPP_RANGES, assign_splits, dedupe
from specstop.prompts.templates import TEMPLATES, register_template, render_template

__all__ = [
    "DISCO_SIZES",
    "MBPP_RANGES",
    "TEMPLATES",
    "PromptRecord",
    "PromptSetConfig",
    "assign_splits",
    "dedupe",
    "humaneval_path",
    "load_prompt_set",
    "load_records",
    "register_template",
    "render_prompt",
    "render_template",
]
