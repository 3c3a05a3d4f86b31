"""The code in README.md, docs/ and the package docstring runs as written, on the tiny pair.

Each page is read top to bottom in a scratch working directory, as a reader would follow it:

* every ``python`` block is executed, in one namespace per page (a block may use what an earlier one
  imported). The names a page leaves to the reader (``pair``, ``target``, ``draft``, ``prompt_ids``,
  ...) are bound to the tiny pair (``_usage_fixtures.reader_namespace``), and the few placeholder
  strings in :data:`PLACEHOLDERS` to fixtures; paths such as ``runs/quickstart/export`` are real
  files in the scratch directory. Blocks that cannot run are listed in :data:`NOT_RUN` with the
  reason, so a new block runs by default;
* every ``specstop ...`` line of a ``bash`` block is parsed by that command's own parser (every flag
  and value), its inputs (:data:`FLAG_INPUTS`) pointed at fixtures; ``decode`` and ``export`` lines
  then run for real (seconds on the tiny pair), except :data:`PARSED_ONLY`. Every
  ``python benchmarks/X.py ...`` line (any script of the repository) is parsed by the script's own
  argparse;
* every ``yaml`` block is loaded by the loader of the config it is (pipeline, generate or train).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from unittest import mock

import pytest
import yaml
from _export_fixtures import single_thread  # noqa: F401 - tiny models run faster on one thread
from _snippets import (
    REPO,
    SHELL_LANGS,
    Block,
    command_argv,
    docstring_blocks,
    fenced_blocks,
    parse_script,
    parse_specstop,
    run_python,
    shell_commands,
    specstop_argv,
    substitute_literals,
)
from _usage_fixtures import reader_namespace, usage_fixtures

from specstop.cli import main

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")),
         REPO / "specstop" / "__init__.py", REPO / "specstop" / "decode" / "hf_settings.py"]

#: Python blocks that do not run here: (page, a line of the block) -> why.
NOT_RUN = {
    ("docs/decoders.md", 'policy.push_to_hub("you/policy")'):
        "uploads to the Hugging Face Hub (network); tests/test_hub_native.py runs both lines against a stand-in Hub",
    ("docs/engines.md", "from vllm import LLM, SamplingParams"):
        "needs vLLM, which lives in its own venv (make vllm-env); tests/test_vllm_engine.py runs vllm.json's options "
        "in vLLM the same way",
    ("docs/engines.md", 'vllm_proposer_config("DRAFT", option["policy"]'):
        "needs vLLM (its own venv); tests/test_vllm_engine.py::test_proposer_with_a_quantized_draft_and_a_batch_cap_is_lossless "
        "runs these settings in vLLM",
}
#: ``specstop`` command lines parsed but not run, though their command is one that runs: why.
PARSED_ONLY = {
    "--policy pearl": "PEARL starts two worker processes (about 15 s on 2 cores); tests/test_pearl_decoder.py runs them",
    "--also-tuned": "needs the policy tuned on data made at another temperature; tests/test_by_decoding.py exports the "
                    "same way from greedy and T = 1 data of the tiny pair",
    "--levels": "names a level model folder the page leaves to the reader; tests/test_levels_cli.py decodes, tunes "
                "and exports a stack of the tiny pair and a level model",
    "runs/levels/": "a tuned stack's files; tests/test_levels_cli.py runs tune --levels, export --policy levels and "
                    "decode of that export",
}
#: Commands that run for real after their line parsed (the others are the heavy stages - data
#: generation, training, calibration, tuning and replay on real data, the 1 GB fetch - and parse only).
RUN = ("decode", "export")
#: Tokens a decode line generates when the line does not say (the tiny pair's output is noise).
DECODE_TOKENS = "32"
#: Placeholder strings of Python blocks -> the fixture that stands in (keys of the ``env`` files).
PLACEHOLDERS = {"DRAFT": "draft", "TARGET": "target", "EXPORT_DIR_OR_REPO_ID": "export", "engines/hf.json": "hf_json",
                "DATA": "data"}
#: Input flags of command lines -> the fixture they read (outputs stay as written, in the scratch folder).
FLAG_INPUTS = {"--pair": "pair", "--data": "data", "--data.data_dir": "data", "--transfer": "data",
               "--checkpoint": "checkpoint", "--node-head": "node_head", "--tuned": "tuned", "--cost-model": "cost",
               "--cost": "cost"}


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_pair_dir, synth_dir):
    from specstop.data_gen.card import write_dataset_card
    from specstop.data_gen.storage import read_manifest
    from specstop.pair import load_named_pair

    root = tmp_path_factory.mktemp("docs")
    fx = usage_fixtures(root / "fx", tiny_pair_dir)
    data = root / "data"  # a dataset with its card (what `specstop generate` writes), for datasets.load_dataset
    shutil.copytree(synth_dir, data)
    write_dataset_card(data, read_manifest(data))
    hf_dir = root / "engines"
    assert main(["export", "--tuned", str(fx.tuned), "--out", str(hf_dir), "--for", "hf"]) == 0
    pair = load_named_pair(str(tiny_pair_dir), dtype="float32", device="cpu")
    files = {"pair": tiny_pair_dir, "draft": tiny_pair_dir / "draft", "target": tiny_pair_dir / "target",
             "export": fx.export, "hf_json": hf_dir / "hf.json", "data": data, "checkpoint": fx.checkpoint,
             "node_head": fx.node_head, "tuned": fx.tuned, "cost": fx.cost}
    return {
        "fx": fx,
        "ns": reader_namespace(pair),
        "placeholders": {text: files[key] for text, key in PLACEHOLDERS.items()},
        "flag_inputs": {flag: files[key] for flag, key in FLAG_INPUTS.items()},
    }


def _scratch(root: Path, fx) -> None:
    """The files the pages name by relative path, and the repository's configs (with the generate config
    the quickstart pipeline writes for its data stage)."""
    shutil.copytree(fx.export, root / "runs" / "quickstart" / "export")
    (root / "configs").symlink_to(REPO / "configs")
    quickstart = yaml.safe_load((REPO / "configs" / "pipelines" / "quickstart.yaml").read_text())
    data = {**quickstart["data"], "pair": quickstart["pair"], "out": "runs/quickstart/data", "dtype": quickstart["dtype"]}
    (root / "runs" / "quickstart" / "configs").mkdir()
    (root / "runs" / "quickstart" / "configs" / "data.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _blocks(page: Path) -> list[Block]:
    rel = str(page.relative_to(REPO))
    if page.suffix == ".py":
        return docstring_blocks(page, rel)
    return fenced_blocks(page.read_text(), rel)


def _not_run(page: str, block: Block) -> str | None:
    return next((why for (p, line), why in NOT_RUN.items() if p == page and line in block.text), None)


def _fill(argv: list[str], inputs: dict) -> list[str]:
    """Input flags' values -> fixtures (a ``NAME=PATH`` checkpoint keeps its name); a bare ``...``
    after a value ("and more like it") is dropped."""
    out = []
    for i, word in enumerate(argv):
        flag, eq, inline = word.partition("=")
        if word == "..." and i and not argv[i - 1].startswith("-"):
            continue
        if eq and flag in inputs:
            out.append(f"{flag}={inputs[flag]}")
        elif i and argv[i - 1] in inputs and not word.startswith("-"):
            name, _, _ = word.rpartition("=") if argv[i - 1] == "--checkpoint" else ("", "", "")
            out.append(f"{name}={inputs[argv[i - 1]]}" if name else str(inputs[argv[i - 1]]))
        else:
            out.append(word)
    return out


def _run_shell(line: str, where: str, env: dict, capsys) -> None:
    argv = command_argv(line)
    if argv[:1] == ["python"] and len(argv) > 1 and argv[1].endswith(".py"):
        assert (REPO / argv[1]).is_file(), f"{where}: `{line}` runs a script that is not in the repository"
        parse_script(REPO / argv[1], _fill(argv[2:], env["flag_inputs"]))
        return
    args = specstop_argv(argv)
    if args is None:
        return  # not specstop (make, pip, venv, ...)
    args = _fill(args, env["flag_inputs"])
    try:
        parsed = parse_specstop(args)
    except AssertionError as err:
        raise AssertionError(f"{where}: `{line}` does not parse: {err}") from None
    name = next(a for a in args if not a.startswith("-"))
    if name == "pipeline":
        _, cfg, flags = parsed
        cfg.validate(flags.config)
    if name not in RUN or any(marker in " ".join(args) for marker in PARSED_ONLY):
        return
    if name == "decode" and "--max-new-tokens" not in args:
        args += ["--max-new-tokens", DECODE_TOKENS]
    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 0, f"{where}: `{line}` failed: {err[-1000:]}"


def _check_yaml(block: Block, tmp: Path) -> None:
    """A YAML block through the loader of the config it is."""
    doc = yaml.safe_load(block.text)
    path = tmp / "block.yaml"
    path.write_text(block.text)
    if {"trainer", "model"} & set(doc):
        parse_specstop(["train", "--config", str(path)])
    elif {"generation", "prompts", "labels"} & set(doc):
        parse_specstop(["generate", "--config", str(path)])
    else:
        from specstop.pipeline.config import PipelineConfig

        PipelineConfig.from_yaml(str(path)).validate(str(path))


def _pearl_on_threads():
    """PearlDecoder's default backend -> threads while a page runs (the process backend starts workers)."""
    from specstop.decode.pearl import PearlDecoder

    return mock.patch.dict(PearlDecoder.__init__.__kwdefaults__, {"backend": "threads"})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_page_code_runs(page, env, tmp_path, monkeypatch, capsys):
    rel = str(page.relative_to(REPO))
    scratch = tmp_path / "work"
    scratch.mkdir()
    _scratch(scratch, env["fx"])
    monkeypatch.chdir(scratch)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    ns = {**env["ns"]}
    with _pearl_on_threads():
        for block in _blocks(page):
            if block.lang in ("python", "py"):
                code = substitute_literals(block.text, env["placeholders"])
                compile(code, block.where, "exec")
                if _not_run(rel, block) is None:
                    run_python(code, ns, block.where)
            elif block.lang in SHELL_LANGS:
                for line in shell_commands(block):
                    _run_shell(os.path.expandvars(line), block.where, env, capsys)
            elif block.lang in ("yaml", "yml"):
                _check_yaml(block, tmp_path)


def test_not_run_entries_match_a_block():
    """Every NOT_RUN entry names a block that exists (a stale entry would silently skip nothing)."""
    for (page, line), _why in NOT_RUN.items():
        blocks = _blocks(REPO / page)
        assert any(line in b.text for b in blocks if b.lang == "python"), f"{page}: no block has {line!r}"
    for marker in PARSED_ONLY:
        assert any(marker in line for page in PAGES for b in _blocks(page) if b.lang in SHELL_LANGS
                   for line in shell_commands(b)), f"no command line has {marker!r}"


def test_flag_filling():
    inputs = {"--checkpoint": Path("/c.ckpt"), "--data": Path("/d")}
    assert _fill(["tune", "--data", "D", "--checkpoint", "n=P", "...", "--prompt", "..."], inputs) == \
        ["tune", "--data", "/d", "--checkpoint", "n=/c.ckpt", "--prompt", "..."]
    assert _fill(["x", "--data=D"], inputs) == ["x", "--data=/d"]
    assert re.fullmatch(r"\d+", DECODE_TOKENS)
