"""Hub-native artifacts: datasets open with `datasets.load_dataset`, exports round-trip through
`from_pretrained` / `push_to_hub` / transformers' `generate(custom_generate=...)`."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import yaml
from _data_gen_helpers import make_render, records
from _export_fixtures import hub_snapshot as _hub_cache
from _export_fixtures import random_exports, single_thread, tiny_prompts  # noqa: F401

from specstop.data_gen import storage
from specstop.data_gen.config import DataGenConfig
from specstop.data_gen.runner import generate_dataset
from specstop.export.runtime import StoppingPolicy


def test_generated_dataset_opens_with_load_dataset(pair, tmp_path):
    import datasets

    cfg = DataGenConfig(prompts_per_shard=2)
    cfg.generation.max_new_tokens = 8
    cfg.labels.hidden_states = True
    cfg.labels.rollouts.length = 4
    cfg.labels.rollouts.splits = ["test"]
    cfg.labels.mixing.draws = 0
    out = tmp_path / "ds"
    generate_dataset(pair, records(7), cfg, out, render=make_render(pair.tokenizer), progress=False)

    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    names = [c["config_name"] for c in meta["configs"]]
    assert "tokens" in names and "rollouts" in names and "mixed" not in names  # no mixing rows: no config

    tokens = datasets.load_dataset(str(out))  # the default config: token rows, one split per split
    assert set(tokens) == {"train", "validation", "test"}
    for split in tokens:
        ref = storage.load_table(out, "tokens", split)
        assert tokens[split]["prompt_id"] == ref["prompt_id"]
        assert tokens[split].features == ref.features
    rollouts = datasets.load_dataset(str(out), "rollouts", split="test")
    assert len(rollouts) == len(storage.load_table(out, "rollouts", "test")) > 0


def test_regenerated_folder_is_not_served_from_the_datasets_cache(pair, tmp_path):
    """datasets keys its cache on the card only: the card must change when the data do."""
    import datasets

    cfg = DataGenConfig(prompts_per_shard=2)
    cfg.generation.max_new_tokens = 6
    cfg.labels.hidden_states = True
    cfg.labels.mixing.draws = 0
    out, cache = tmp_path / "ds", tmp_path / "hf-cache"
    generate_dataset(pair, records(5), cfg, out, render=make_render(pair.tokenizer), progress=False)
    assert "hidden" in datasets.load_dataset(str(out), split="train", cache_dir=str(cache)).column_names
    shutil.rmtree(out)
    cfg.labels.hidden_states = False
    generate_dataset(pair, records(5), cfg, out, render=make_render(pair.tokenizer), progress=False)
    again = datasets.load_dataset(str(out), split="train", cache_dir=str(cache))
    assert "hidden" not in again.column_names
    assert again["token"] == storage.load_table(out, "tokens", "train")["token"]


def test_export_is_a_hub_model_repo(exports):
    folder = exports["disco"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "specstop_stopping_policy"
    card = (folder / "README.md").read_text()
    assert card.startswith("---\n")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "specstop" and "speculative-decoding" in meta["tags"]
    assert meta["specstop"]["policy"]["kind"] == "predictor"
    generate_py = (folder / "custom_generate" / "generate.py").read_text()
    assert str(folder.resolve()) not in generate_py  # found from custom_generate= at call time
    assert "custom_generate_source()" in generate_py


def test_from_pretrained_accepts_a_hub_id(exports, monkeypatch):
    import huggingface_hub

    calls = {}

    def fake_snapshot_download(repo_id, **kwargs):
        calls["repo_id"], calls["allow"] = repo_id, kwargs.get("allow_patterns")
        return str(exports["sdpp"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    policy = StoppingPolicy.from_pretrained("someone/sdpp-policy", revision="main")
    assert calls["repo_id"] == "someone/sdpp-policy" and "model.safetensors" in calls["allow"]
    local = StoppingPolicy.from_pretrained(exports["sdpp"])
    for a, b in zip(policy.predictor.state_dict().values(), local.predictor.state_dict().values()):
        assert torch.equal(a, b)


def test_from_pretrained_reads_a_hub_id_from_the_real_cache_layout(exports, hub_cache):
    snapshot = _hub_cache(hub_cache, "someone/sdpp-policy", exports["sdpp"])
    assert (snapshot / "model.safetensors").resolve().parent.name == "blobs"
    policy = StoppingPolicy.from_pretrained("someone/sdpp-policy")
    local = StoppingPolicy.from_pretrained(exports["sdpp"])
    for a, b in zip(policy.predictor.state_dict().values(), local.predictor.state_dict().values()):
        assert torch.equal(a, b)
    # The snapshot folder itself (what snapshot_download returns) loads as a folder too.
    assert StoppingPolicy.from_pretrained(snapshot).config["policy"] == local.config["policy"]


def test_custom_generate_runs_a_hub_id_from_the_real_cache_layout(pair, exports, hub_cache, monkeypatch):
    from specstop.decode import hf_assist

    _hub_cache(hub_cache, "someone/disco-policy", exports["disco"])
    rounds = []
    original = hf_assist.PolicyCandidateGenerator.get_candidates

    def spy(self, input_ids, **kwargs):
        out = original(self, input_ids, **kwargs)
        rounds.append(self.last_k)
        return out

    monkeypatch.setattr(hf_assist.PolicyCandidateGenerator, "get_candidates", spy)
    x = torch.tensor([tiny_prompts(pair, ("def f(x):",))[0]])
    ref = pair.target.generate(x, max_new_tokens=8, do_sample=False)
    out = pair.target.generate(x, assistant_model=pair.draft, max_new_tokens=8, do_sample=False,
                               custom_generate="someone/disco-policy", trust_remote_code=True)
    assert out[0].tolist() == ref[0].tolist()
    assert rounds, "custom_generate did not draft through the policy"


def test_cache_links_that_leave_the_repos_own_blobs_are_refused(exports, hub_cache, tmp_path):
    from specstop.errors import UserError

    snapshot = _hub_cache(hub_cache, "someone/sdpp-policy", exports["sdpp"])
    other = _hub_cache(hub_cache, "else/disco-policy", exports["disco"])
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(exports["sdpp"] / "model.safetensors", outside)
    weights = snapshot / "model.safetensors"
    for target in (outside, (other / "model.safetensors").resolve()):  # anywhere else, another repo's blob
        weights.unlink()
        weights.symlink_to(os.path.relpath(target, weights.parent))
        with pytest.raises(UserError, match="points outside"):
            StoppingPolicy.from_pretrained("someone/sdpp-policy")
    # A plain export folder still keeps its weights inside itself.
    folder = tmp_path / "plain"
    shutil.copytree(exports["sdpp"], folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(UserError, match="points outside"):
        StoppingPolicy.from_pretrained(folder)


def test_push_to_hub_uploads_the_export_layout(exports, monkeypatch, tmp_path):
    from huggingface_hub import hub_mixin

    uploaded = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return type("Url", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kwargs):
            files = {p.relative_to(folder_path).as_posix(): p.read_bytes() for p in folder_path.rglob("*") if p.is_file()}
            uploaded.update(repo_id=repo_id, files=files)
            return f"https://hub.invalid/{repo_id}/commit/1"

    monkeypatch.setattr(hub_mixin, "HfApi", FakeApi)
    policy = StoppingPolicy.from_pretrained(exports["disco"])
    url = policy.push_to_hub("someone/disco-policy")
    assert url.endswith("/commit/1") and uploaded["repo_id"] == "someone/disco-policy"
    files = uploaded["files"]
    assert {"config.json", "model.safetensors", "README.md", "custom_generate/generate.py"} <= set(files)
    # The same generate.py as a local export: it names no repository and no path.
    assert files["custom_generate/generate.py"] == (exports["disco"] / "custom_generate" / "generate.py").read_bytes()
    assert json.loads(files["config.json"])["predictor"] == json.loads((exports["disco"] / "config.json").read_text())["predictor"]
    # What was uploaded loads back to the same predictor.
    back = tmp_path / "back"
    for rel, data in files.items():
        (back / rel).parent.mkdir(parents=True, exist_ok=True)
        (back / rel).write_bytes(data)
    again = StoppingPolicy.from_pretrained(back)
    for a, b in zip(again.predictor.state_dict().values(), policy.predictor.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["disco", "sdpp"])
def test_custom_generate_runs_the_learned_policy(name, pair, exports, monkeypatch):
    from specstop.decode import hf_assist

    rounds = []
    original = hf_assist.PolicyCandidateGenerator.get_candidates

    def spy(self, input_ids, **kwargs):
        out = original(self, input_ids, **kwargs)
        rounds.append(self.last_k)
        return out

    monkeypatch.setattr(hf_assist.PolicyCandidateGenerator, "get_candidates", spy)
    for ids in tiny_prompts(pair, ("hello world", "def f(x):")):
        x = torch.tensor([ids])
        ref = pair.target.generate(x, max_new_tokens=16, do_sample=False)
        out = pair.target.generate(
            x, assistant_model=pair.draft, max_new_tokens=16, do_sample=False,
            custom_generate=str(exports[name]), trust_remote_code=True,
        )
        assert out[0].tolist() == ref[0].tolist()
    assert rounds, "custom_generate did not draft through the policy"
    assert "_get_candidate_generator" not in vars(pair.target)


def test_a_moved_export_still_runs_through_custom_generate(pair, exports, tmp_path, monkeypatch):
    """generate.py finds its policy from custom_generate=, so a moved (or pushed) export needs nothing by hand."""
    from specstop.decode import hf_assist

    moved = tmp_path / "elsewhere" / "policy"
    shutil.copytree(exports["disco"], moved)
    seen = []
    original = hf_assist.generate_with_policy

    def spy(model, *args, policy, **kwargs):
        seen.append(str(policy))
        return original(model, *args, policy=policy, **kwargs)

    monkeypatch.setattr(hf_assist, "generate_with_policy", spy)
    monkeypatch.delitem(__import__("specstop").__dict__, "generate_with_policy", raising=False)
    x = torch.tensor([tiny_prompts(pair, ("def f(x):",))[0]])
    ref = pair.target.generate(x, max_new_tokens=8, do_sample=False)
    out = pair.target.generate(x, assistant_model=pair.draft, max_new_tokens=8, do_sample=False,
                               custom_generate=str(moved), trust_remote_code=True)
    assert out[0].tolist() == ref[0].tolist()
    assert seen == [str(moved)]


def test_custom_generate_source_outside_generate_names_the_fix():
    from specstop.errors import UserError
    from specstop.export.hub import custom_generate_source

    with pytest.raises(UserError, match="stopping_policy="):
        custom_generate_source()


def test_custom_generate_needs_the_draft(pair, exports):
    x = torch.tensor([tiny_prompts(pair, ("hi",))[0]])
    with pytest.raises(ValueError, match="assistant_model"):
        pair.target.generate(x, max_new_tokens=4, custom_generate=str(exports["disco"]), trust_remote_code=True)


def test_export_for_hf_writes_settings_and_the_custom_generate_folder(exports, tmp_path, capsys):
    from specstop.cli import main

    tuned = exports["disco"].parent / "tuned.json"
    out = tmp_path / "hf"
    assert main(["export", "--tuned", str(tuned), "--out", str(out), "--for", "hf"]) == 0
    settings = json.loads((out / "hf.json").read_text())
    learned = settings["options"]["disco"]  # the learned predictor with the lowest validation latency
    assert learned["generate_kwargs"] == {"custom_generate": str(out.resolve()), "trust_remote_code": True}
    assert (out / "custom_generate" / "generate.py").is_file() and (out / "model.safetensors").is_file()
    assert "custom_generate=" in capsys.readouterr().out
    # The package is written in a temporary folder and renamed into place: generate.py names no
    # folder at all (it reads custom_generate= at call time), and the engine file survives the rename.
    generate_py = (out / "custom_generate" / "generate.py").read_text()
    assert str(out.resolve()) not in generate_py and ".tmp-" not in generate_py and "specstop.export" not in generate_py


def test_export_for_hf_again_needs_overwrite_and_keeps_the_settings(exports, tmp_path, capsys):
    from specstop.cli import main

    tuned = exports["disco"].parent / "tuned.json"
    out = tmp_path / "hf"
    args = ["export", "--tuned", str(tuned), "--out", str(out), "--for", "hf"]
    assert main(args) == 0
    assert main(args) == 2  # an existing export is replaced only on request
    assert "pass --overwrite" in capsys.readouterr().err
    (out / "hf.json").unlink()
    assert main([*args, "--overwrite"]) == 0
    assert (out / "hf.json").is_file() and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no temporary folders left
