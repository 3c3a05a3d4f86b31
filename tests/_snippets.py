"""What docs and written artifacts tell users to run, extracted and run.

* :func:`fenced_blocks` / :func:`docstring_blocks`: the code blocks of a Markdown text or of a module
  docstring (``::`` blocks), with where each starts.
* :func:`shell_commands`: the command lines of a shell block (backslash continuations joined,
  comments dropped, ``NAME=value`` assignments expanded in later lines).
* :func:`run_python`: exec a snippet in a namespace, after checking that the only names it leaves to
  the reader are the ones the caller binds.
* :func:`parse_specstop` / :func:`parse_script`: a ``specstop`` command line parsed by the command's
  real parser (every flag and value), or a ``python benchmarks/X.py`` line by the script's own
  argparse, stopping right after the parse (the heavy stage does not run).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import importlib
import io
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")
SHELL_LANGS = ("bash", "sh", "shell", "console")


@dataclass
class Block:
    """A code block: ``where`` is ``file:line`` of its first line."""

    where: str
    lang: str
    text: str


def fenced_blocks(text: str, source: str) -> list[Block]:
    """Every fenced code block of a Markdown text (the language as written after the fence, may be '')."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not FENCE.match(lines[j]):
            j += 1
        out.append(Block(f"{source}:{i + 2}", m.group(1).lower(), "\n".join(lines[i + 1:j])))
        i = j + 1
    return out


def docstring_blocks(path: Path, where: str | None = None) -> list[Block]:
    """The indented blocks of a module's docstring (reST literal blocks: after ``::`` or a blank
    line, indented), dedented."""
    import textwrap

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines, out, i = doc.splitlines(), [], 1
    while i < len(lines):
        if not (lines[i].startswith("    ") and lines[i].strip()) or lines[i - 1].strip() and \
                not lines[i - 1].rstrip().endswith("::"):
            i += 1
            continue
        j = i
        while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
            j += 1
        text = textwrap.dedent("\n".join(lines[i:j])).strip("\n")
        out.append(Block(f"{where or path.name} docstring line {i + 2}", "python", text))
        i = j
    return out


def shell_commands(block: Block) -> list[str]:
    """The command lines of a shell block, continuations joined, comments and blank lines dropped,
    ``NAME=value`` lines applied to later ``$NAME`` / ``${NAME}``."""
    joined, cur = [], ""
    for line in block.text.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        joined.append(cur + line)
        cur = ""
    out, env = [], {}
    for line in joined:
        text = " ".join(shlex.split(line, comments=True)) if line.strip() else ""
        if not text:
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)=(\S*)", text)
        if m:
            env[m.group(1)] = m.group(2)
            continue
        for name, value in env.items():
            line = re.sub(rf"\$\{{?{name}\}}?\b", value, line)
        out.append(line)
    return out


def command_argv(line: str) -> list[str]:
    """``shlex`` words of a command line (comments dropped)."""
    return shlex.split(line, comments=True)


# ------------------------------------------------------------------------------------------------
# Python snippets
# ------------------------------------------------------------------------------------------------


def free_names(code: str) -> set[str]:
    """Names a snippet reads but never binds (assignment, import, for, with, def, comprehension)."""
    tree = ast.parse(code)
    bound, loaded = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


def run_python(code: str, namespace: dict, where: str) -> dict:
    """Exec ``code`` in ``namespace`` (updated in place) after checking every name it leaves to the
    reader is bound there. Returns the namespace."""
    missing = free_names(code) - set(namespace)
    assert not missing, f"{where}: the snippet uses {sorted(missing)}, which nothing binds (not runnable as written)"
    exec(compile(code, where, "exec"), namespace)  # noqa: S102 - running what the docs say is the point
    return namespace


def substitute_literals(code: str, table: dict[str, object]) -> str:
    """Replace quoted string literals equal to a key of ``table`` with the repr of its value."""
    for key, value in table.items():
        code = re.sub(rf"(['\"]){re.escape(key)}\1", lambda _m, v=value: repr(str(v)), code)
    return code


# ------------------------------------------------------------------------------------------------
# Command lines: parse only
# ------------------------------------------------------------------------------------------------


class Parsed(Exception):
    """Raised right after a command's parser accepted its arguments: ``result`` is what it built."""

    def __init__(self, result):
        super().__init__("parsed")
        self.result = result


@contextlib.contextmanager
def _parse_only_specstop() -> Iterator[None]:
    from specstop.config_cli import TypedCommand

    original = TypedCommand.parse

    def parse(self, argv):
        raise Parsed((self.prog, *original(self, argv)))

    with mock.patch.object(TypedCommand, "parse", parse):
        yield


#: Programs that run the command given after them (``srun specstop train ...``).
LAUNCHERS = ("srun", "mpirun", "nice", "time", "env")


def specstop_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``specstop`` of a command line that runs specstop (``specstop X``,
    ``srun specstop X``, ``torchrun ... -m specstop.cli X``), else None (``pip install specstop`` ...)."""
    if argv[:1] == ["specstop"] or (argv[:1] and argv[0] in LAUNCHERS and "specstop" in argv):
        return argv[argv.index("specstop") + 1:]
    for i, word in enumerate(argv[:-1]):
        if word == "-m" and argv[i + 1] in ("specstop", "specstop.cli"):
            return argv[i + 2:]
    return None


def parse_specstop(argv: list[str]):
    """Parse ``specstop ARGV`` with the command's own parser and stop there.

    Returns ``(prog, settings, flags)`` for the dataclass commands, ``("specstop train", config)`` for
    LightningCLI. Raises AssertionError naming the problem when the parser refuses the line.
    """
    from specstop.cli import COMMANDS

    name = next((a for a in argv if not a.startswith("-")), None)
    assert name in COMMANDS, f"unknown command {name!r} (choose from {', '.join(COMMANDS)})"
    rest = argv[argv.index(name) + 1:]
    module = importlib.import_module(COMMANDS[name][0])
    err = io.StringIO()
    try:
        with _parse_only_specstop(), contextlib.redirect_stderr(err):
            if name == "train":
                _parse_train(module, rest)
            else:
                module.main(rest)
    except Parsed as done:
        return done.result
    except SystemExit as exit_:
        raise AssertionError(f"specstop {name} exited ({exit_.code}) while parsing: {err.getvalue()[-1500:]}") from None
    except Exception as exc:
        raise AssertionError(f"specstop {name}: {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"specstop {name} ran without parsing its arguments through its command parser")


def _parse_train(module, argv: list[str]) -> None:
    """LightningCLI parses, then calls ``before_instantiate_classes``: stop there."""

    def stop(self):
        raise Parsed(("specstop train", self.config))

    with mock.patch.object(module.SpecstopCLI, "before_instantiate_classes", stop):
        module.main(argv)


@contextlib.contextmanager
def script_context(script: Path, argv: list[str]) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGV`` sets them."""
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))
    try:
        yield
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


def run_script(script: Path, argv: list[str]) -> int:
    """``python SCRIPT ARGV`` in this process (as ``__main__``). Returns its exit status."""
    with script_context(script, argv):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
            return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def parse_script(script: Path, argv: list[str]) -> argparse.Namespace:
    """Parse ``python SCRIPT ARGV`` with the script's own argparse and stop there."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    err = io.StringIO()
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), contextlib.redirect_stderr(err):
            code = run_script(script, argv)
    except Parsed as done:
        return done.result
    raise AssertionError(f"{script.name} {' '.join(argv)}: exited {code} without parsing: {err.getvalue()[-1500:]}")
