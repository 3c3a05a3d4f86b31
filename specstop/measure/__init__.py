"""measure: what runs on this machine, timed - the cost table (``specstop calibrate-cost``: step
times, token-tree and batch sections, PEARL's core split) and the online checks of real decoders
against the target alone.

Offline replay and the cost *model* it prices with live in :mod:`specstop.eval`; this package
imports them, never the other way round.
"""
