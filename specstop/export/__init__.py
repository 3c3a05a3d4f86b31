"""export: the self-describing predictor package (folder format, runtime, hub) and serving-engine settings.

The decoders that load a package live in :mod:`specstop.decode`.
"""
