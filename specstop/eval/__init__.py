"""eval: exact replay of speculative decoding under stopping policies, cost models, tuning, reports.

Everything here works from recorded data and a cost table; timing real models on this machine is
:mod:`specstop.measure`.
"""
