"""eval: exact replay of speculative decoding under stopping policies, cost models, tuning, reports."""
