"""prompts: prompt sources (shipped sets, hub ids, JSON/JSONL files, HumanEval), the papers' templates, splits."""

from specstop.prompts.builtin import BUILTINS, builtin_path
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
    "BUILTINS",
    "DISCO_SIZES",
    "MBPP_RANGES",
    "TEMPLATES",
    "PromptRecord",
    "PromptSetConfig",
    "assign_splits",
    "builtin_path",
    "dedupe",
    "humaneval_path",
    "load_prompt_set",
    "load_records",
    "register_template",
    "render_prompt",
    "render_template",
]
