"""data_gen: run a real target and draft over prompts and label every draft position."""
