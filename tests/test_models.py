"""Predictor families: shapes, parameter counts, no weight sharing, registry, checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specstop.errors import UserError
from specstop.models import (
    FeatureSpec,
    build_predictor,
    get_predictor_class,
    predictor_names,
    register_predictor,
)
from specstop.models.checkpoint import load_predictor, save_predictor_checkpoint


def n_params(m) -> int:
    return sum(p.numel() for p in m.parameters())


def lin(i, o) -> int:
    return i * o + o


@pytest.mark.parametrize(
    "family, config, input_dim, expected",
    [
        ("disco_ffn", {}, 12, lin(12, 64) + lin(64, 1)),  # top-10 + entropy + position
        ("disco_ffn", {"use_position": False, "hidden_dim": 8}, 11, lin(11, 8) + lin(8, 1)),
        ("mcsd_topk_mlp", {}, 11, lin(11, 44) + lin(44, 1)),  # upstream 11 -> 44 -> 1
        ("mcsd_hidden_mlp", {"hidden_size": 768}, 768, lin(768, 512) + lin(512, 256) + lin(256, 1)),
        ("mcsd_hidden_mlp", {"hidden_size": 48}, 48, lin(48, 32) + lin(32, 16) + lin(16, 1)),
        ("specdecpp_resnet", {"hidden_size": 32, "depth": 0}, 32, lin(32, 1)),
        ("specdecpp_resnet", {"hidden_size": 32, "depth": 3}, 32, 3 * lin(32, 32) + lin(32, 1)),
    ],
)
def test_shapes_and_parameter_counts(family, config, input_dim, expected):
    m = build_predictor(family, **config)
    assert m.feature_spec.input_dim == input_dim
    assert n_params(m) == expected
    out = m(torch.randn(5, input_dim))
    assert out.shape == (5,)
    p = m.predict_proba(torch.randn(3, input_dim))
    assert p.shape == (3,) and ((p > 0) & (p < 1)).all()
    assert m.default_label in m.labels


def test_resnet_blocks_do_not_share_weights():
    m = build_predictor("specdecpp_resnet", hidden_size=16, depth=4)
    ptrs = {b.linear.weight.data_ptr() for b in m.blocks}
    assert len(ptrs) == 4
    assert len({id(p) for p in m.parameters()}) == len(list(m.parameters()))
    before = [b.linear.weight.detach().clone() for b in m.blocks]
    with torch.no_grad():
        m.blocks[0].linear.weight.add_(1.0)
    assert not torch.equal(m.blocks[0].linear.weight, before[0])
    for b, w in zip(m.blocks[1:], before[1:]):
        assert torch.equal(b.linear.weight, w)
    x = torch.randn(2, 16)
    h = x + torch.nn.functional.silu(m.blocks[0].linear(x))  # residual + SiLU, as in SpecDec++
    assert torch.allclose(m.blocks[0](x), h)


def test_resnet_depth_range():
    with pytest.raises(ValueError, match="0..4"):
        build_predictor("specdecpp_resnet", hidden_size=8, depth=5)


def test_registry_names_and_errors():
    assert set(predictor_names()) >= {"disco_ffn", "specdecpp_resnet", "mcsd_hidden_mlp", "mcsd_topk_mlp"}
    with pytest.raises(UserError, match="valid names: .*disco_ffn"):
        get_predictor_class("nope")
    with pytest.raises(ValueError, match="already registered"):

        @register_predictor("disco_ffn")
        class Dup(get_predictor_class("mcsd_topk_mlp")):
            pass


def test_feature_spec_build():
    spec = FeatureSpec(kind="dist", k=3, use_position=True, position_scale=1024.0)
    x = spec.build(torch.tensor([[0.5, 0.2, 0.1, 0.05]]), torch.tensor([1.0]), torch.tensor([1023]))
    assert x.shape == (1, 5) and torch.allclose(x[0, :3], torch.tensor([0.5, 0.2, 0.1]))
    assert abs(float(x[0, 4]) - 1.0) < 1e-3  # log1p(1023) / log1p(1024) ~ 1
    with pytest.raises(ValueError, match="hidden_size > 0"):
        FeatureSpec(kind="hidden")


@pytest.mark.parametrize("family, config", [("disco_ffn", {}), ("specdecpp_resnet", {"hidden_size": 8, "depth": 2})])
def test_checkpoint_roundtrip_torch_only(tmp_path, family, config):
    m = build_predictor(family, **config)
    path = save_predictor_checkpoint(tmp_path / "p.ckpt", m, {"label": m.default_label, "w_rej": 3.0})
    m2, meta = load_predictor(path)
    x = torch.randn(7, m.feature_spec.input_dim)
    assert torch.equal(m.eval()(x), m2(x))
    assert meta["family"] == family and meta["w_rej"] == 3.0 and meta["feature_spec"] == m.feature_spec.to_dict()
    with pytest.raises(FileNotFoundError, match="specstop train"):
        load_predictor(tmp_path / "missing.ckpt")


def test_checkpoint_module_imports_no_lightning():
    code = "import sys, specstop.models.checkpoint; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
