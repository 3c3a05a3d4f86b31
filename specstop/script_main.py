"""The entry point of every script in ``benchmarks/``: a user's mistake is one line, not a traceback.

A script ends with ``run_main(main, __file__)``. The rule is the ``specstop`` command's
(:func:`specstop.cli.user_message`): a :class:`~specstop.errors.UserError`, a missing extra or an
output the machine cannot write is one line on stderr and exit status 2; anything else is a bug
and keeps its traceback. A script also opens files its user named deep inside libraries, so a
missing file or folder is one line too. ``SPECSTOP_DEBUG=1`` shows the traceback of all of them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

#: Errors that name a path the user gave which is not there (or not what was needed).
MISSING_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _debug() -> bool:
    return os.environ.get("SPECSTOP_DEBUG", "").strip() not in ("", "0")


def _missing_path_message(err: BaseException) -> str | None:
    """One line for an OS error about a path that is missing or of the wrong kind, else None."""
    if isinstance(err, MISSING_PATH_ERRORS) and getattr(err, "filename", None):
        what = {FileNotFoundError: "no such file or folder", NotADirectoryError: "not a folder",
                IsADirectoryError: "a folder, not a file"}
        kind = next(text for cls, text in what.items() if isinstance(err, cls))
        return f"{err.filename}: {kind}; check the path"
    return None


def script_error_line(err: BaseException, script: str) -> str | None:
    """The one line a script prints for ``err``, or None when ``err`` is a bug.

    Args:
        err: the exception the script's ``main`` raised.
        script: the script's path (its file name starts the line).
    """
    from specstop.cli import cap, user_message

    name = Path(script).name
    message = user_message(err, f"python {name}") or _missing_path_message(err)
    if message is None:
        return None
    return f"{name}: error: {cap(message)} (SPECSTOP_DEBUG=1 shows a traceback)"


def run_main(main: Callable[[], int | None], script: str) -> NoReturn:
    """Run a script's ``main()`` and exit with its status; a user's mistake exits with one line.

    Args:
        main: the script's ``main``, called without arguments (it parses ``sys.argv``).
        script: the script's ``__file__``.

    Raises:
        SystemExit: always: ``main``'s status, 130 on Ctrl-C, 2 after the one-line message (the
            ``specstop`` command's status for a user's mistake).
    """
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"{Path(script).name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        line = script_error_line(err, script)
        if line is None or _debug():
            raise
        print(line, file=sys.stderr)
        sys.exit(2)
    sys.exit(code)
