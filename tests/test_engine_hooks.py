"""Engines' native hooks. `specstop export --for sglang` writes the tuned batch schedule as an SGLang
AdaptiveSpecPolicy, and that policy does what SGLang's AdaptiveController asks of one; `--for trtllm` says why it
writes no confidence-scheduling files (a DSpark-only option).

SGLang is not installed here (its CPU build needs an AMX Xeon, its registry build CUDA), so the controller's
use of a policy is re-stated below from its source, read, not run:
sgl-project/sglang python/sglang/srt/speculative/adaptive_runtime_state.py at
02a3cd954bab7765c272d17886e8af5ca7add79d (``AdaptiveSpecPolicy`` protocol, ``AdaptiveController``:
``init_states`` builds one runtime state per candidate step with ``cuda_graph_bs_for_step``, then activates the
worker's startup step; ``activate_step_by_batch`` switches to ``get_steps_for_batch``; ``on_verify_complete``
switches to a returned step; a step without a state raises), and the newer revision of the same file that
passes ``num_steps`` to ``on_verify_complete`` and calls ``on_state_activated``.
"""

from __future__ import annotations

import inspect
import json
import shlex

import pytest

from specstop.cli import main
from specstop.decode.sglang_policy import POLICY_CLASS, SpecstopAdaptivePolicy
from specstop.errors import UserError
from specstop.export.engines import validate_engine_file
from specstop.policy import PolicySpec

SCHEDULE = {"format": 1, "cost_model": "batched-cost-v1", "entries": [
    {"batch_size": 1, "k": 4, "predicted_speedup": 1.42, "predicted_speedup_by_k": {}, "threshold": None},
    {"batch_size": 4, "k": 6, "predicted_speedup": 1.25, "predicted_speedup_by_k": {}, "threshold": None},
    {"batch_size": 16, "k": 2, "predicted_speedup": 1.08, "predicted_speedup_by_k": {}, "threshold": None},
    {"batch_size": 64, "k": 0, "predicted_speedup": 1.0, "predicted_speedup_by_k": {}, "threshold": None},
]}
#: The tuned K at each batch size, by the tiers' rule (a key is the smallest batch size of its tier).
EXPECTED = {**{b: 4 for b in range(1, 4)}, **{b: 6 for b in range(4, 16)}, **{b: 2 for b in range(16, 64)},
            **{b: 0 for b in range(64, 130)}}

#: The protocol's members and the arguments the controller passes (both revisions).
PROTOCOL_CALLS = {
    "set_cuda_graph_bs": [([1, 2, 4],), (None,)],
    "get_steps_for_batch": [(8,)],
    "on_verify_complete": [([1, 0, 2], 3), ([1, 0, 2], 3, 4)],
    "cuda_graph_bs_for_step": [(2,)],
    "on_state_activated": [(2,)],
}


class _Controller:
    """SGLang's AdaptiveController as it uses a policy (see the module docstring for the source read)."""

    def __init__(self, policy, startup_steps: int, newer: bool):
        self.policy, self.newer = policy, newer
        self.states = {startup_steps: "registered by the worker"}  # the worker's own state, all graphs
        self.active = startup_steps

    def init_states(self, cuda_graph_bs):
        self.policy.set_cuda_graph_bs(cuda_graph_bs)
        for steps in self.policy.candidate_steps:
            if steps not in self.states:
                self.states[steps] = self.policy.cuda_graph_bs_for_step(steps)
        self._activate(self.active)

    def _activate(self, steps: int):
        if steps not in self.states:
            raise AssertionError(f"Missing adaptive runtime state for steps={steps}")
        self.active = steps
        if self.newer:
            self.policy.on_state_activated(steps)

    def decode_round(self, batch_size: int, accepted: list[int]) -> int:
        target = self.policy.get_steps_for_batch(batch_size)
        if target != self.active:
            self._activate(target)
        ran = self.active
        args = (accepted, batch_size, ran) if self.newer else (accepted, batch_size)
        new = self.policy.on_verify_complete(*args)
        if new is not None:
            self._activate(new)
        return ran


def _export(tmp_path, engine: str = "sglang") -> dict:
    def entry(spec, speedup):
        return {"spec": spec.to_dict(), "validation": {"speedup": speedup, "tokens_per_round": 2.5}}

    tuned = {"schema_version": 1, "policies": {"static_opt": entry(PolicySpec(kind="static", k=4), 1.4)},
             "best": "static_opt", "cost_model": {"t_draft": 0.01, "t_target": 0.03}, "batch_schedule": SCHEDULE}
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    out = tmp_path / "engines"
    assert main(["export", "--tuned", str(tmp_path / "tuned.json"), "--out", str(out), "--for", engine,
                 "--draft-name", "d", "--target-name", "t"]) == 0
    return json.loads((out / f"{engine}.json").read_text())


@pytest.mark.parametrize("newer", [False, True])
def test_exported_policy_runs_the_tuned_k_under_sglangs_controller(tmp_path, newer):
    sched = _export(tmp_path)["batch_schedule"]
    policy_info = sched["policy"]
    assert policy_info["class"] == POLICY_CLASS and "STANDALONE" in policy_info["applies_to"]
    flags = sched["flags"]
    startup = int(flags[flags.index("--speculative-num-steps") + 1])
    # the usage line names the tiers file that was written, by its full path
    assert repr(policy_info["tiers"]) in policy_info["usage"] and policy_info["tiers"] == shlex.split(
        sched["command"])[-1]
    policy = SpecstopAdaptivePolicy.from_file(policy_info["tiers"], initial_steps=startup)

    ctl = _Controller(policy, startup, newer)
    ctl.init_states([1, 2, 4, 8, 16, 32, 64, 128])
    assert sorted(ctl.states) == [0, 2, 4, 6]
    # each state captures graphs only for the batch sizes that reach its step
    assert ctl.states[6] == [4, 8] and ctl.states[2] == [16, 32] and ctl.states[0] == [64, 128]
    ran = {b: ctl.decode_round(b, [1] * b) for b in (1, 3, 4, 15, 16, 63, 64, 128, 2, 1)}
    assert ran == {b: EXPECTED[b] for b in ran}
    assert policy.candidate_steps == [0, 2, 4, 6]
    assert policy.get_steps_for_batch(0) == policy.current_steps  # an empty batch keeps the state


def test_policy_answers_every_protocol_call():
    policy = SpecstopAdaptivePolicy({1: 3, 8: 1}, initial_steps=5)
    assert policy.candidate_steps == [1, 3, 5]  # the worker's startup step always has a state
    for name, calls in PROTOCOL_CALLS.items():
        method = getattr(policy, name)
        for args in calls:
            inspect.signature(method).bind(*args)  # TypeError if the controller's call does not fit
            method(*args)
    assert policy.on_verify_complete([0, 0], 2) is None  # the tuned K depends on the batch size only
    policy.set_cuda_graph_bs(None)
    assert policy.cuda_graph_bs_for_step(3) is None  # graphs off


@pytest.mark.parametrize("content, message", [
    (None, "no such tiers file"),
    ("{not json", "not a readable JSON tiers file"),
    ('{"1": {"candidate_steps": [2, 4]}}', "holding one integer"),
    ('{"2": {"candidate_steps": [2]}}', "ascend from 1"),
    ('{"x": {"candidate_steps": [2]}}', "must be a batch size"),
])
def test_bad_tiers_file_is_one_line_naming_the_fix(tmp_path, content, message):
    path = tmp_path / "sglang_adaptive.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=message) as err:
        SpecstopAdaptivePolicy.from_file(path, initial_steps=2)
    assert "\n" not in str(err.value) and "specstop export --for sglang" in str(err.value)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update({"class": "my.Policy"}), "policy.class must be"),
    (lambda p: p.update({"tiers": "other.json"}), "policy.tiers must name"),
])
def test_validation_refuses_an_edited_policy(tmp_path, edit, message):
    data = _export(tmp_path)
    edit(data["batch_schedule"]["policy"])
    with pytest.raises(UserError, match=message):
        validate_engine_file("sglang", data)


def test_trtllm_file_says_confidence_scheduling_is_dsparks_and_writes_none(tmp_path):
    """TensorRT-LLM reads enable_confidence_scheduling on DSparkDecodingConfig only, with a cost table measured in
    the live engine and bound to its fingerprint (tensorrt_llm/_torch/speculative/dspark_planner.py at
    NVIDIA/TensorRT-LLM 7fbff6f775388d49f6f6618b77aa9a1b5c115c5c, load_runtime_sps_cost_table) and confidence-head
    temperatures (dspark_sts.py at 0ee1e73f39abbdf6fed7451ebf2102c8b8f1a60e): the Draft_Target files carry none of
    those fields, and say why."""
    data = _export(tmp_path, "trtllm")
    assert "DSpark" in data["confidence_scheduling"] and "draft_len_schedule" in data["confidence_scheduling"]
    written = sorted(p.name for p in (tmp_path / "engines").iterdir())
    assert written == ["trtllm.json", "trtllm_batch_schedule.yaml", "trtllm_static_opt.yaml"]
    for name in written[1:]:
        text = (tmp_path / "engines" / name).read_text()
        assert "confidence" not in text and "decoding_type: Draft_Target" in text
    validate_engine_file("trtllm", data)
