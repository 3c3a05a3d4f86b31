"""What the written artifacts tell users to run runs: the usage lines of ``hf.json``, the commands of
the engine files, the code and commands of an export's model card and ``custom_generate/generate.py``,
and the code of a dataset card - each produced by the real writer on the tiny pair, extracted, and
executed (Python in-process, ``specstop`` commands through the CLI). Server commands of engines that
are not installed here are checked for what they name: the program, the flags of their option, and
every file they read, which must exist where the command says from any working directory.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil

import pytest
import yaml
from _export_fixtures import single_thread  # noqa: F401 - tiny models run faster on one thread
from _snippets import command_argv, docstring_blocks, fenced_blocks, free_names, run_python
from _usage_fixtures import reader_namespace, usage_fixtures

from specstop.cli import main

MAX_NEW = 16  # tokens per generate() in the checks below (the usage lines ask for 128; see _shorter)


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_pair_dir):
    """``export --for all`` of the fixtures' tuned file (the learned policy's package plus every engine
    file), a token-tree export, the fixtures and the reader's namespace."""
    from specstop.pair import load_named_pair

    root = tmp_path_factory.mktemp("artifacts")
    fx = usage_fixtures(root / "fx", tiny_pair_dir)
    out = root / "engines"
    assert main(["export", "--tuned", str(fx.tuned), "--out", str(out), "--for", "all"]) == 0
    tree = root / "tree_export"
    assert main(["export", "--tuned", str(fx.tuned), "--policy", "tree_opt", "--out", str(tree)]) == 0
    pair = load_named_pair(str(tiny_pair_dir), dtype="float32", device="cpu")
    return {"fx": fx, "out": out, "tree": tree, "pair": pair, "ns": reader_namespace(pair), "root": root}


def _shorter(code: str) -> str:
    """The snippet with ``max_new_tokens=128`` cut to :data:`MAX_NEW` (the tiny pair's output is noise)."""
    return re.sub(r"max_new_tokens=\d+", f"max_new_tokens={MAX_NEW}", code)


def _public_imports_only(code: str, where: str) -> None:
    """Artifacts outlive the specstop that wrote them: their code imports the public API only."""
    import specstop

    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specstop":
            assert node.module == "specstop", f"{where}: imports from {node.module}; use `from specstop import ...`"
            unknown = [a.name for a in node.names if a.name not in specstop.__all__]
            assert not unknown, f"{where}: {unknown} are not public names of specstop"
        elif isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] != "specstop" or a.name == "specstop" for a in node.names), where


def _target_greedy(written, max_new: int) -> list[int]:
    ns = written["ns"]
    return ns["target"].generate(**ns["inputs"], max_new_tokens=max_new, do_sample=False)[0].tolist()


def test_every_hf_option_runs_as_its_usage_line_says(written):
    hf = json.loads((written["out"] / "hf.json").read_text())
    assert {"static_opt", "heuristic_opt", "confidence_opt", "disco_ffn"} <= set(hf["options"])
    ref = _target_greedy(written, MAX_NEW)
    for name, option in hf["options"].items():
        where = f"hf.json option {name} usage"
        assert option.get("usage"), f"{where}: missing"
        _public_imports_only(option["usage"], where)
        # Everything else (the settings file, the option) is written into the line itself.
        assert free_names(option["usage"]) <= {"target", "draft", "inputs"}, f"{where}: {option['usage']}"
        ns = run_python(_shorter(option["usage"]), dict(written["ns"]), where)
        assert ns["out"][0].tolist() == ref, f"{where}: greedy output differs from the target's"  # lossless


def _commands(node) -> list[str]:
    """Every ``command`` string anywhere in an engine file."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "command" and isinstance(v, str)] + \
            [c for k, v in node.items() if k != "command" for c in _commands(v)]
    if isinstance(node, list):
        return [c for v in node for c in _commands(v)]
    return []


PROGRAMS = {"vllm": ["vllm", "serve"], "llamacpp": ["llama-server"], "sglang": ["python", "-m", "sglang.launch_server"],
            "trtllm": ["trtllm-serve", "serve"]}


def _contains(argv: list[str], flags: list[str]) -> bool:
    return any(argv[i:i + len(flags)] == flags for i in range(len(argv) - len(flags) + 1))


def test_engine_commands_name_their_flags_and_files_by_a_path_that_exists(written, tmp_path, monkeypatch):
    out = written["out"]
    monkeypatch.chdir(tmp_path)  # a user runs the command from wherever they copied it to
    for engine, program in PROGRAMS.items():
        settings = json.loads((out / f"{engine}.json").read_text())
        assert settings.get("batch_schedule"), f"{engine}: the fixture's tuned schedule is not in the file"
        commands = _commands(settings)
        assert len(commands) >= 2, f"{engine}: expected option and schedule commands"
        for command in commands:
            argv = shlex.split(command)
            assert argv[:len(program)] == program, f"{engine}: {command!r} does not run {' '.join(program)}"
            for word in argv:
                if re.search(r"\.(ya?ml|json)$", word) and not word.startswith("{"):
                    assert word.startswith("/") and (tmp_path / word).is_file(), \
                        f"{engine}: {command!r} names {word}, which is not there from another folder"
        for name, option in settings["options"].items():
            argv = shlex.split(option["command"])
            if option.get("flags"):
                assert _contains(argv, option["flags"]), f"{engine} {name}: command lacks the option's flags"
            if engine == "vllm":
                conf = argv[argv.index("--speculative-config") + 1]
                assert json.loads(conf) == option["speculative_config"]
                if option.get("additional_config"):  # specstop's proposer: its draft and policy
                    extra = json.loads(argv[argv.index("--additional-config") + 1])
                    assert extra == option["additional_config"]
                    policy = extra["specstop"]["policy"]
                    assert isinstance(policy, dict) or (policy.startswith("/") and (tmp_path / policy).is_dir())
            if engine == "trtllm":
                path = argv[argv.index("--extra_llm_api_options") + 1]
                assert yaml.safe_load(open(path)) == option["llm_api_options"]
        sched = settings["batch_schedule"]
        if engine == "sglang":
            argv = shlex.split(sched["command"])
            path = argv[argv.index("--speculative-adaptive-config") + 1]
            assert json.loads(open(path).read()) == sched["adaptive_config"] and _contains(argv, sched["flags"])
        if engine == "trtllm":
            argv = shlex.split(sched["command"])
            conf = yaml.safe_load(open(argv[argv.index("--extra_llm_api_options") + 1]))["speculative_config"]
            assert conf["draft_len_schedule"] == {int(b): k for b, k in
                                                  sched["llm_api_options"]["speculative_config"]["draft_len_schedule"].items()}


def _inline_commands(text: str) -> list[str]:
    return re.findall(r"`(specstop [^`]+)`", text)


def _run_card(written, folder, tmp_path, capsys) -> None:
    card = (folder / "README.md").read_text()
    blocks = [b for b in fenced_blocks(card, f"{folder.name}/README.md") if b.lang == "python"]
    assert blocks, "the model card shows no code"
    ns = {**written["ns"], "REPO_OR_DIR": str(folder)}
    for block in blocks:
        _public_imports_only(block.text, block.where)
        run_python(_shorter(block.text), ns, block.where)
    # The commands the card names, its placeholders filled in.
    fill = {"PAIR": str(written["fx"].pair_dir), "DIR": str(folder), "TEXT": "hello", "TUNED": str(written["fx"].tuned),
            "OUT": str(tmp_path / "card_out")}
    commands = _inline_commands(card)
    assert commands, "the model card names no specstop command"
    for command in commands:
        argv = [fill.get(w, w) for w in command_argv(command)][1:]
        if argv[0] == "decode":
            argv += ["--max-new-tokens", str(MAX_NEW)]
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 0, f"{folder.name}/README.md: `{command}` failed: {err[-800:]}"


def test_model_card_code_and_commands_run(written, tmp_path, capsys):
    _run_card(written, written["out"], tmp_path, capsys)


def test_token_tree_model_card_code_and_commands_run(written, tmp_path, capsys):
    _run_card(written, written["tree"], tmp_path, capsys)


def test_custom_generate_entry_point_runs_as_its_docstring_says(written):
    folder = written["out"]
    blocks = docstring_blocks(folder / "custom_generate" / "generate.py")
    assert blocks
    ref = _target_greedy(written, MAX_NEW)
    for block in blocks:
        ns = run_python(_shorter(block.text), {**written["ns"], "REPO_OR_DIR": str(folder)}, block.where)
        assert ns["out"][0].tolist() == ref


def test_dataset_card_code_runs(synth_dir, tmp_path, monkeypatch):
    import datasets

    from specstop.data_gen.card import write_dataset_card
    from specstop.data_gen.storage import read_manifest

    data = tmp_path / "data"
    shutil.copytree(synth_dir, data)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    card = write_dataset_card(data, read_manifest(data)).read_text()
    blocks = [b for b in fenced_blocks(card, "data/README.md") if b.lang == "python"]
    assert blocks
    for block in blocks:
        run_python(block.text, {"DATA": str(data)}, block.where)
