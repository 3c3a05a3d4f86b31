"""prompts: prompt sources (hub ids, JSON/JSONL files, HumanEval), the papers' templates, splits."""
