"""Templates render exactly as the papers specify; splits are deterministic and disjoint."""

from __future__ import annotations

import json

import pytest

from specstop.prompts import (
    DISCO_SIZES,
    PromptSetConfig,
    assign_splits,
    load_prompt_set,
    register_template,
    render_prompt,
    render_template,
)
from specstop.prompts.templates import TEMPLATES
from specstop.testing import tiny_tokenizer

MBPP_REC = {"task_id": 2, "text": "Write a function to add.", "test_list": ["assert add(1, 2) == 3", "assert x"]}


# ---- templates -------------------------------------------------------------------------------


def test_mbpp_template_is_disco_fig7():
    assert render_template("mbpp", MBPP_REC) == '"""Write a function to add.\nassert add(1, 2) == 3\n"""'


def test_humaneval_template_is_the_prompt_field_verbatim():
    rec = {"prompt": "def f(x):\n    \"\"\"doc\"\"\"\n", "task_id": "HumanEval/0"}
    assert render_template("humaneval", rec) == rec["prompt"]


def test_cnn_dm_template_is_disco_fig8():
    assert render_template("cnn_dm", {"article": "A B C.", "highlights": "x"}) == "Summarize:\nA B C.\nSummary:\n"


def test_alpaca_templates_are_stanfords():
    with_input = render_template("alpaca", {"instruction": "Translate.", "input": "Hallo", "output": ""})
    assert with_input == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nTranslate.\n\n### Input:\nHallo\n\n### Response:"
    )
    for empty in ("", "   ", None):
        no_input = render_template("alpaca", {"instruction": "Say hi.", "input": empty})
        assert no_input == (
            "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n"
            "### Instruction:\nSay hi.\n\n### Response:"
        )


def test_gsm8k_field_and_format_templates():
    assert render_template("gsm8k", {"question": "1+1?", "answer": "2"}) == "1+1?"
    assert render_template("field:answer", {"question": "1+1?", "answer": "2"}) == "2"
    assert render_template("Q: {question}\nA:", {"question": "1+1?"}) == "Q: 1+1?\nA:"
    assert render_template("{text} / {test_list[1]}", MBPP_REC) == "Write a function to add. / assert x"


def test_registered_template(monkeypatch):
    monkeypatch.setitem(TEMPLATES, "dummy", TEMPLATES["gsm8k"])  # restore registry afterwards
    register_template("dummy", "<<{question}>>")
    assert render_template("dummy", {"question": "q"}) == "<<q>>"


@pytest.mark.parametrize(
    "template, record, match",
    [
        ("mbpp", {"text": "x"}, "test_list"),
        ("{missing}", {"a": 1}, "missing"),
        ("field:nope", {"a": 1}, "nope"),
        ("no-such-template", {"a": 1}, "unknown prompt template"),
    ],
)
def test_template_errors_name_the_problem(template, record, match):
    with pytest.raises(ValueError, match=match):
        render_template(template, record)


# ---- splits ----------------------------------------------------------------------------------


def _all(splits):
    return [i for idx in splits.values() for i in idx]


def test_random_split_is_deterministic_and_disjoint():
    a = assign_splits(1000, "random", DISCO_SIZES, seed=3)
    b = assign_splits(1000, "random", DISCO_SIZES, seed=3)
    c = assign_splits(1000, "random", DISCO_SIZES, seed=4)
    assert a == b and a != c
    assert {k: len(v) for k, v in a.items()} == DISCO_SIZES
    assert len(set(_all(a))) == len(_all(a))


def test_random_split_scales_down_small_sets(caplog):
    s = assign_splits(66, "random", DISCO_SIZES, seed=0)
    sizes = {k: len(v) for k, v in s.items()}
    assert sum(sizes.values()) == 66 and sizes["train"] == 50 and sizes["validation"] == sizes["test"] == 8
    assert "shrinking" in caplog.text


def test_random_split_rest():
    s = assign_splits(100, "random", {"train": -1, "validation": 10, "test": 10}, seed=0)
    assert [len(v) for v in s.values()] == [80, 10, 10]
    assert sorted(_all(s)) == list(range(100))


def test_all_scheme_and_bad_scheme():
    assert assign_splits(5, "all:test") == {"test": [0, 1, 2, 3, 4]}
    sub = assign_splits(50, "all:test", {"test": 10}, seed=1)
    assert len(sub["test"]) == 10 and sub == assign_splits(50, "all:test", {"test": 10}, seed=1)
    with pytest.raises(ValueError, match="unknown split scheme"):
        assign_splits(5, "kfold")


def test_mbpp_scheme_uses_task_id_ranges():
    ids = list(range(1, 975))
    s = assign_splits(len(ids), "mbpp", None, ids=ids)
    assert {k: len(v) for k, v in s.items()} == {"train": 374, "validation": 90, "test": 500}
    assert min(ids[i] for i in s["train"]) == 601 and min(ids[i] for i in s["test"]) == 11
    assert not any(ids[i] <= 10 for i in _all(s))  # few-shot examples are excluded
    disco = assign_splits(len(ids), "mbpp", {"train": -1, "validation": 80, "test": 80}, seed=0, ids=ids)
    assert {k: len(v) for k, v in disco.items()} == {"train": 374, "validation": 80, "test": 80}


def test_prompt_set_dedupes_across_splits(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"p{i % 40}"} for i in range(100)]  # 40 unique texts, each repeated
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = PromptSetConfig(source=str(path), chat_template=False, split_sizes={"train": -1, "test": 10})
    recs = load_prompt_set(cfg)
    texts = [r.text for r in recs]
    assert len(texts) == len(set(texts)) == 40
    assert sum(r.split == "test" for r in recs) == 10
    assert [(r.prompt_id, r.split) for r in recs] == [(r.prompt_id, r.split) for r in load_prompt_set(cfg)]
    assert recs[0].split == "train" and recs[0].meta == {"prompt": recs[0].text}


def test_limit_caps_each_split(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"question": f"q{i}", "id": f"x{i}"} for i in range(30)]))
    cfg = PromptSetConfig(source=str(path), template="gsm8k", split_sizes={"train": 20, "test": 10}, limit=3)
    recs = load_prompt_set(cfg)
    assert [r.split for r in recs] == ["train"] * 3 + ["test"] * 3
    assert all(r.prompt_id == f"x{r.source_index}" for r in recs)


def test_empty_prompt_names_its_id(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "  "}\n')
    with pytest.raises(ValueError, match="'b'"):
        load_prompt_set(PromptSetConfig(source=str(path)))


def test_missing_file_and_offline_hub_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_set(PromptSetConfig(source=str(tmp_path / "nope.jsonl")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="network"):
        load_prompt_set(PromptSetConfig(source="no-such-org/no-such-dataset-xyz"))


# ---- real data -------------------------------------------------------------------------------


def test_humaneval_loads_offline():
    cfg = PromptSetConfig(source="humaneval", template="humaneval", split_scheme="all:test")
    recs = load_prompt_set(cfg)
    assert len(recs) == 164 and recs[0].prompt_id == "HumanEval/0"
    assert recs[0].text.startswith("from typing import List") and recs[0].meta["entry_point"]
    sub = load_prompt_set(PromptSetConfig(source="humaneval", template="humaneval", split_scheme="all:test",
                                          split_sizes={"test": 80}, seed=0))  # fmt: skip
    assert len(sub) == 80 and {r.split for r in sub} == {"test"}


def test_mbpp_official_split(shared_dataset):
    cfg = PromptSetConfig(source=str(shared_dataset("mbpp.jsonl")), template="mbpp", split_scheme="mbpp",
                          split_sizes={"train": -1, "validation": 80, "test": 80})  # fmt: skip
    recs = load_prompt_set(cfg)
    counts = {s: sum(r.split == s for r in recs) for s in ("train", "validation", "test")}
    assert counts["validation"] == counts["test"] == 80 and 370 <= counts["train"] <= 374
    ranges = {"train": (601, 974), "validation": (511, 600), "test": (11, 510)}
    assert all(ranges[r.split][0] <= int(r.prompt_id) <= ranges[r.split][1] for r in recs)
    first = recs[0]
    assert first.text == f'"""{first.meta["text"]}\n{first.meta["test_list"][0]}\n"""'
    assert len({r.text for r in recs}) == len(recs)


def test_other_shared_datasets_render(shared_dataset):
    for name, template, needle in (("cnn_dailymail.jsonl", "cnn_dm", "Summarize:\n"),
                                   ("alpaca.jsonl", "alpaca", "### Instruction:\n"),
                                   ("gsm8k_test.jsonl", "gsm8k", "")):  # fmt: skip
        recs = load_prompt_set(PromptSetConfig(source=str(shared_dataset(name)), template=template, limit=5))
        assert len(recs) == 15 and all(needle in r.text for r in recs)


# ---- rendering to ids ------------------------------------------------------------------------


def test_render_prompt_with_and_without_chat_template():
    tok = tiny_tokenizer()
    plain = render_prompt("hi", tok, chat_template=False)
    assert plain == tok("hi")["input_ids"] and all(isinstance(i, int) for i in plain)
    chat = render_prompt("hi", tok, chat_template=True)
    assert isinstance(chat, list) and all(isinstance(i, int) for i in chat)
    assert tok.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    sys_ = render_prompt("hi", tok, chat_template=True, system_prompt="Be brief.")
    assert tok.decode(sys_).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")


def test_render_prompt_errors():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="p7"):
        render_prompt("", tok, chat_template=True, prompt_id="p7")
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template: false"):
        render_prompt("hi", tok, chat_template=True)


# ---- shipped prompt sets ---------------------------------------------------------------------


def _config_prompt_sections(path):
    """Every ``prompts`` mapping of a data or pipeline config."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    sections = [doc.get("prompts")]
    for key in ("data", "test_data"):
        if isinstance(doc.get(key), dict):
            sections.append(doc[key].get("prompts"))
    return [s for s in sections if s]


def test_every_shipped_config_resolves_its_prompts_inside_the_package():
    from pathlib import Path

    from specstop.prompts import load_records

    root = Path(__file__).resolve().parents[1]
    configs = sorted((root / "configs").rglob("*.yaml"))
    checked = 0
    for path in configs:
        for section in _config_prompt_sections(path):
            source = section["source"]
            assert ".." not in source and not Path(source).is_absolute(), f"{path}: {source} leaves the repository"
            records = load_records(PromptSetConfig(source=source, template=section.get("template", "field:prompt")))
            assert records, f"{path}: {source} holds no records"
            checked += 1
    assert checked >= 10  # every data and pipeline recipe names a prompt set


def test_builtin_sets_match_their_declared_sizes_and_render():
    from specstop.prompts import BUILTINS, load_records

    for name, template, needle in (("mbpp", "mbpp", '"""'), ("alpaca", "alpaca", "### Instruction:\n"),
                                   ("cnn_dailymail", "cnn_dm", "Summarize:\n")):  # fmt: skip
        assert len(load_records(PromptSetConfig(source=f"builtin:{name}"))) == BUILTINS[name].records
        recs = load_prompt_set(PromptSetConfig(source=f"builtin:{name}", template=template, limit=5))
        assert len(recs) == 15 and all(needle in r.text for r in recs)


def test_builtin_sets_equal_the_shared_originals(shared_dataset):
    """The shipped files hold the same records as ../shared/datasets (so recipes' splits are unchanged)."""
    sizes = {"train": 50, "validation": 5, "test": 5}
    for name, field_name in (("mbpp", "text"), ("alpaca", "instruction"), ("cnn_dailymail", "article")):
        def split(source, field_name=field_name):
            cfg = PromptSetConfig(source=source, template=f"field:{field_name}", split_sizes=sizes)
            return [(r.prompt_id, r.text, r.split, r.meta) for r in load_prompt_set(cfg)]

        assert split(f"builtin:{name}") == split(str(shared_dataset(f"{name}.jsonl")))


def test_unknown_builtin_and_missing_shared_path_name_the_fix():
    with pytest.raises(ValueError, match="builtin:mbpp"):
        load_prompt_set(PromptSetConfig(source="builtin:nope"))
    with pytest.raises(FileNotFoundError, match="builtin:mbpp"):
        load_prompt_set(PromptSetConfig(source="/nowhere/shared/datasets/mbpp.jsonl"))
