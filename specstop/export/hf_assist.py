"""The import path that ``custom_generate/generate.py`` of exports written before the decoders moved
to :mod:`specstop.decode` calls; those exports keep working. The code is :mod:`specstop.decode.hf_assist`."""

from specstop.decode.hf_assist import generate_with_policy

__all__ = ["generate_with_policy"]
