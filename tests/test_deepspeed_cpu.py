"""DeepSpeed's real engine on CPU: ZeRO stage 2 trains a predictor, and its sharded checkpoint loads.

Lightning's DeepSpeed strategy refuses anything but CUDA GPUs, so ``specstop train --strategy
deepspeed_stage_2`` runs on GPUs only (``make gpu-check`` trains with it there). What runs on CPU is the
engine itself, through DeepSpeed's CPU accelerator: this test trains a predictor with ZeRO stage 2, saves
its checkpoint in the layout Lightning's strategy writes (the engine's own ``save_checkpoint``, tag
``checkpoint``, the module under ``_forward_module``), and loads it through :func:`load_predictor`, which
consolidates the shards with Lightning's real converter. Nothing is mocked.

``make test-deepspeed-cpu`` installs DeepSpeed and runs it; without DeepSpeed it skips.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

if os.environ.get("SPECSTOP_REQUIRE_DEEPSPEED"):  # make test-deepspeed-cpu: a missing install fails
    import deepspeed
else:
    deepspeed = pytest.importorskip("deepspeed")
pytest.importorskip("lightning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _LightningLayout(torch.nn.Module):
    """The module tree Lightning hands DeepSpeed: its wrapper's ``_forward_module`` is the
    LightningModule, whose ``predictor`` is the network (checkpoint keys ``predictor.*``)."""

    def __init__(self, predictor: torch.nn.Module) -> None:
        super().__init__()
        self._forward_module = torch.nn.Module()
        self._forward_module.predictor = predictor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_module.predictor(x)


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()


def test_zero_stage_2_trains_a_predictor_on_cpu_and_its_checkpoint_loads(tmp_path, one_rank):
    from deepspeed.accelerator import get_accelerator

    from specstop.models import build_predictor
    from specstop.models.checkpoint import load_predictor, save_predictor_checkpoint
    from specstop.train.loss import weighted_bce_with_logits

    assert get_accelerator().device_name() == "cpu"
    torch.manual_seed(0)
    predictor = build_predictor("disco_ffn", k=10)
    start = {k: v.clone() for k, v in predictor.state_dict().items()}
    config = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=_LightningLayout(predictor), config=config,
                                           model_parameters=predictor.parameters())
    assert engine.zero_optimization_stage() == 2

    # Labels a predictor can learn: accept when the top probability (first feature) is high.
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(512, predictor.feature_spec.input_dim, generator=gen)
    y = (x[:, 0] > 0.5).float()
    losses = []
    for _epoch in range(6):
        for i in range(0, len(x), 32):
            loss = weighted_bce_with_logits(engine(x[i:i + 32]), y[i:i + 32], w_rej=3.0)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    assert sum(losses[-16:]) / 16 < 0.8 * sum(losses[:16]) / 16, losses

    # Lightning's client state beside the shards: what specstop train writes through the strategy.
    written = tmp_path / "written.ckpt"
    save_predictor_checkpoint(written, predictor, {"label": "greedy_match", "w_rej": 3.0})
    client = {k: v for k, v in torch.load(written, weights_only=True).items() if k != "state_dict"}
    folder = tmp_path / "best-00.ckpt"
    engine.save_checkpoint(str(folder), tag="checkpoint", client_state=client)
    assert (folder / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()

    loaded, meta = load_predictor(folder)
    assert meta["family"] == "disco_ffn" and meta["label"] == "greedy_match" and meta["w_rej"] == 3.0
    trained = predictor.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.allclose(value.float(), trained[name].float(), atol=1e-6), name
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the engine's steps changed them
    assert os.path.isfile(tmp_path / "best-00.fp32.ckpt")  # consolidated once, beside the folder
