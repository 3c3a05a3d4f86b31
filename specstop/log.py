"""specstop's own logger: the ``specstop`` namespace, never the root logger.

Every module logs through ``logging.getLogger(__name__)`` (a child of ``specstop``). The CLI calls
:func:`setup_logging` once per process, which gives the ``specstop`` logger one stderr handler with
the ``[specstop]`` prefix. Other libraries' loggers (transformers, huggingface_hub, lightning) are
left alone, so their messages are neither prefixed nor printed twice.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "specstop"
PREFIX_FORMAT = "[specstop] %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (pytest and notebooks swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns it; we always use sys.stderr
        pass


def setup_logging(verbose: bool = False) -> logging.Logger:
    """Give the ``specstop`` logger its stderr handler (once) and set its level.

    Args:
        verbose: DEBUG instead of INFO.

    Returns:
        The ``specstop`` logger.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(PREFIX_FORMAT))
        logger.addHandler(handler)
    return logger
