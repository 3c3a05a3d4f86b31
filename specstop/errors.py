"""The one error type for mistakes the user can fix.

The CLI prints a :class:`UserError` as one line (``specstop CMD: error: ...``) and exits with
status 2; every other exception is a bug and keeps its traceback. ``SPECSTOP_DEBUG=1`` (or ``-v``)
shows the traceback of user errors too.

``UserError`` subclasses ``ValueError`` so library callers that already catch ``ValueError`` keep
working; :class:`MissingInputError` is also a ``FileNotFoundError`` for the same reason. Only this
module is imported by the dependency-light export runtime, so it imports nothing.
"""

from __future__ import annotations


class UserError(ValueError):
    """Input the user can fix (a bad flag, config, file or model); the message names the fix."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (or is not what the command needs)."""


class ResourceLimitError(UserError, MemoryError):
    """A stage stopped before the machine ran out of memory; finished work is kept."""


def find_user_error(err: BaseException | None) -> UserError | None:
    """``err`` itself or the :class:`UserError` it was explicitly raised from (``raise X from
    user_error``: libraries such as jsonargparse wrap the errors our constructors raise), else None.

    Only ``__cause__`` counts: a bug raised *while handling* a user error (``__context__``) is
    still a bug.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, UserError):
            return err
        seen.add(id(err))
        err = err.__cause__
    return None
