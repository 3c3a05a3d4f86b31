"""``specstop calibrate-cost --engine llamacpp`` against a stand-in llama-server with known costs
(tests/_fake_llama_server.py): the cost model must read back the server's own step and round costs,
and the settings exported from it must say llama.cpp's costs priced them."""

from __future__ import annotations

import json

import pytest
from _fake_llama_server import DRAFT_MS, TARGET_MS, VERIFY_MS_PER_TOKEN
from _fake_llama_server import install as install_fake_llama_server

from specstop.cli import main
from specstop.eval.cost import load_cost_model
from specstop.eval.episodes import load_replay_data
from specstop.eval.replay import replay
from specstop.export.engines import priced_by
from specstop.policy import PolicySpec


@pytest.fixture
def gguf_pair(tmp_path):
    for name in ("draft.gguf", "target.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    return tmp_path / "draft.gguf", tmp_path / "target.gguf"


def _calibrate(tmp_path, gguf_pair, *extra) -> int:
    draft, target = gguf_pair
    server = install_fake_llama_server(tmp_path)
    return main(["calibrate-cost", "--engine", "llamacpp", "--draft", str(draft), "--target", str(target),
                 "--llama-server", str(server), "--k-grid", "1,2,4", "--budget", "49", "--threads", "1",
                 "--out", str(tmp_path / "llamacpp_cost.json"), *extra])


def test_the_cost_model_reads_back_the_servers_costs(tmp_path, gguf_pair):
    assert _calibrate(tmp_path, gguf_pair) == 0
    cost = load_cost_model(tmp_path / "llamacpp_cost.json")
    assert cost.provenance == "measured" and cost.machine["engine"] == "llamacpp b1234"
    assert cost.t_draft == pytest.approx(DRAFT_MS / 1e3)
    assert cost.single_step == pytest.approx(TARGET_MS / 1e3)
    for k in (1, 2, 4):  # a round of K: K draft steps, then the target verifying K + 1 tokens
        assert cost.round_cost(k) == pytest.approx((k * DRAFT_MS + TARGET_MS + VERIFY_MS_PER_TOKEN * k) / 1e3)
        assert cost.fit["acceptance_at_k"][str(k)] == pytest.approx((k // 2) / k)
    assert cost.policy_per_step == {}  # llama.cpp's p_min check is inside its draft step
    assert priced_by(cost.to_dict(), "llamacpp").startswith("llamacpp's own costs, measured inside llamacpp b1234")
    assert priced_by(cost.to_dict(), "vllm").startswith("llamacpp's costs") and "an estimate for vllm" in \
        priced_by(cost.to_dict(), "vllm")


def test_a_server_whose_port_was_taken_after_it_was_picked_starts_again_on_another(tmp_path, gguf_pair, monkeypatch):
    """A port picked free can be taken before the server binds it (another process's connection): the server
    exits saying so, and is started again on a new port; the sweep goes on."""
    import socket

    from specstop.measure import llamacpp_cost

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    picks = iter([held.getsockname()[1]])
    real = llamacpp_cost._free_port
    monkeypatch.setattr(llamacpp_cost, "_free_port", lambda: next(picks, None) or real())
    try:
        assert _calibrate(tmp_path, gguf_pair) == 0
    finally:
        held.close()
    assert load_cost_model(tmp_path / "llamacpp_cost.json").t_draft == pytest.approx(DRAFT_MS / 1e3)


def test_a_tuned_export_is_priced_by_llamacpp_and_recommends_none_when_nothing_pays(tmp_path, gguf_pair, synth_dir):
    assert _calibrate(tmp_path, gguf_pair) == 0
    tuned = tmp_path / "tuned.json"
    assert main(["tune", "--data", str(synth_dir), "--sl-max-grid", "4,8", "--cost-model", str(tmp_path / "llamacpp_cost.json"),
                 "--out", str(tuned)]) == 0
    assert main(["export", "--tuned", str(tuned), "--out", str(tmp_path / "engines"), "--for", "llamacpp"]) == 0
    settings = json.loads((tmp_path / "engines" / "llamacpp.json").read_text())
    assert settings["priced_by"].startswith("llamacpp's own costs")
    speeds = {n: o["predicted"]["speedup"] for n, o in settings["options"].items()}
    # the confidence option is predicted under llama.cpp's own p_min rule: the tuning split replayed with
    # each draft ending before the failing token, priced by the same costs
    conf = settings["options"]["confidence_opt"]
    data = load_replay_data(synth_dir, "validation")
    own = replay(data, PolicySpec.from_dict(conf["policy"]), drop_failing=True).metrics(
        load_cost_model(tmp_path / "llamacpp_cost.json"))
    assert conf["predicted"]["speedup"] == pytest.approx(own["speedup"])
    assert conf["predicted"]["tokens_per_round"] == pytest.approx(own["tokens_per_round"])
    tuned_conf = json.loads(tuned.read_text())["policies"]["confidence_opt"]["validation"]
    assert conf["predicted_specstop_rule"]["speedup"] == pytest.approx(tuned_conf["speedup"])
    assert "llama.cpp's rule" in conf["caveat"] and settings["options"]["static_opt"]["caveat"] is None
    if max(speeds.values()) < 1.0:
        assert settings["recommended"] is None and "without speculation" in settings["no_speculation"]
    else:
        assert settings["recommended"] == max(speeds, key=speeds.get)


def test_bad_input_gets_one_line(tmp_path, gguf_pair, capsys):
    draft, target = gguf_pair
    server = str(install_fake_llama_server(tmp_path))
    cases = [(["--draft", str(tmp_path), "--target", str(target), "--llama-server", server], "is not a GGUF file"),
             (["--draft", str(draft), "--target", str(target), "--llama-server", str(tmp_path / "nope")],
              "is not an executable file"),
             (["--draft", str(draft), "--target", str(target), "--llama-server", server, "--batch-grid", "2"],
              "drop --batch-grid"),
             (["--draft", str(draft), "--target", str(target), "--llama-server", server, "--draft-quant", "int4"],
              "GGUF files' own quantization")]
    for args, message in cases:
        assert main(["calibrate-cost", "--engine", "llamacpp", *args, "--out", str(tmp_path / "c.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (message, err)
    assert not (tmp_path / "c.json").exists()
