"""Every import of specstop in the repository resolves: the modules exist and define the names taken
from them. Read with ``ast`` from every Python file under specstop/, tests/, benchmarks/ and scripts/
(imports inside functions included: they run only when that path does) and from the Python code
blocks of README.md, docs/ and the package docstring; dotted ``specstop.x.y`` names the docs mention
resolve too, as do the lazy public names of ``specstop``.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from _snippets import REPO, docstring_blocks, fenced_blocks

PY_DIRS = ("specstop", "tests", "benchmarks", "scripts")
#: Markdown read by users: README.md and docs/ (results pages included).
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
#: Module docstrings that show the public API in code.
API_DOCSTRINGS = [REPO / "specstop" / "__init__.py", REPO / "specstop" / "decode" / "hf_settings.py"]


def _python_sources() -> list[tuple[str, str]]:
    out = [(str(p.relative_to(REPO)), p.read_text()) for d in PY_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    for doc in DOCS:
        out += [(b.where, b.text) for b in fenced_blocks(doc.read_text(), str(doc.relative_to(REPO)))
                if b.lang in ("python", "py")]
    for path in API_DOCSTRINGS:
        out += [(b.where, b.text) for b in docstring_blocks(path, str(path.relative_to(REPO)))]
    return out


def _package_of(where: str) -> str:
    """``specstop/a/b.py`` -> ``specstop.a`` (the package relative imports start from)."""
    parts = Path(where.split(":")[0]).with_suffix("").parts
    return ".".join(parts[:-1])


def _imports(where: str, code: str) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every specstop import (names empty for ``import specstop.x``)."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "specstop"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = _package_of(where).split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            if module.split(".")[0] == "specstop":
                out.append((node.lineno, module, [a.name for a in node.names if a.name != "*"]))
    return out


#: Packages of another environment (tests/test_install_surface.py, OTHER_ENVIRONMENT): a specstop module
#: that imports one at its top (specstop.decode.vllm_worker, loaded by vLLM's worker) is read instead.
OTHER_ENVIRONMENT = ("vllm",)


def _defined_in_source(module: str) -> set[str] | None:
    """The top-level names ``module``'s source defines (classes, functions, assignments, imports), or None
    without a source file."""
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return None
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _import(module: str):
    """``module`` imported; for one that needs a package of :data:`OTHER_ENVIRONMENT`, the names its source
    defines (a set), read without importing it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name in OTHER_ENVIRONMENT and (names := _defined_in_source(module)) is not None:
            return names
        raise


def _missing(module: str, names: list[str]) -> str | None:
    try:
        mod = _import(module)
    except ImportError as err:
        return f"import {module}: {err}"
    if isinstance(mod, set):
        return next((f"{module} has no {name}" for name in names if name not in mod), None)
    for name in names:
        if hasattr(mod, name):
            continue
        try:  # a submodule of a package: `from specstop.decode import cli`
            importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError:
            return f"{module} has no {name}"
    return None


def test_every_specstop_import_in_the_repository_resolves():
    sources = _python_sources()
    assert len(sources) > 150
    seen, bad = {}, []
    for where, code in sources:
        for line, module, names in _imports(where, code):
            key = (module, tuple(names))
            if key not in seen:
                seen[key] = _missing(module, names)
            if seen[key]:
                bad.append(f"{where} line {line}: {seen[key]}")
    assert not bad, "imports that do not resolve:\n" + "\n".join(bad)


def test_lazy_public_names_are_defined_where_they_point():
    import specstop

    for name, module in specstop._PUBLIC.items():
        assert name in vars(importlib.import_module(module)), f"specstop.{name} points at {module}, which lacks it"
    assert set(specstop.__all__) == {"__version__", *specstop._PUBLIC}


DOTTED = re.compile(r"(?<![\w/.])specstop(?:\.[A-Za-z_]\w*)+")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = _import(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        if isinstance(obj, set):  # read from source: its top-level names only
            return len(parts) == i or (parts[i] in obj and len(parts) == i + 1)
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_dotted_names_and_repository_paths_in_the_docs_exist():
    """``specstop.decode.node_head.load_tree_export`` and ``benchmarks/online_speedup.py`` as the docs
    name them (``X`` / ``<name>`` in a path is a placeholder)."""
    path_re = re.compile(r"(?<![\w/.~-])((?:specstop|benchmarks|configs|scripts|tests|docs)/[\w./-]*\w)")
    bad = []
    for doc in DOCS:
        rel = doc.relative_to(REPO)
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            bad += [f"{rel}:{n}: {m.group(0)}" for m in DOTTED.finditer(line) if not _resolves(m.group(0).rstrip("."))]
            for m in path_re.finditer(line):
                path = m.group(1)
                if re.search(r"/X\.\w+$", path) or (REPO / path).exists() or (doc.parent / path).exists():
                    continue
                bad.append(f"{rel}:{n}: {path}")
    assert not bad, "the docs name what does not exist:\n" + "\n".join(bad)
