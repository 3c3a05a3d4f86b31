"""Fixtures every test file may use, and the one way to import test helpers.

Tiny models come from :mod:`specstop.testing` (also used by the benchmarks' smoke runs); builders
shared by several test files live in ``tests/_*.py`` and are imported by their bare module name
(``from _export_fixtures import ...``), which works under ``pytest`` and ``python -m pytest`` alike.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the network: fail fast instead of waiting on hub timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `dtype: auto` picks bf16 on CPUs with bf16 matrix units; tests compare outputs bit for bit, so they
# run in float32 on every machine (tests/test_fast_paths.py covers the choice itself).
os.environ.setdefault("SPECSTOP_CPU_DTYPE", "float32")

try:
    # Lightning gives its loggers a stream handler bound to sys.stderr when first imported: import it
    # here, so the handler holds the real stderr rather than the capture of whichever test imported it
    # first (closed once that test ends, every later log line would raise "I/O operation on closed file").
    import lightning.pytorch  # noqa: F401
except ImportError:  # the core install has no Lightning
    pass

REPO = Path(__file__).resolve().parents[1]
SHARED_DATASETS = REPO.parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory):
    """A tiny random pair saved as ``<dir>/{draft,target}`` Hugging Face folders."""
    from specstop.testing import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("pair") / "tiny")


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """An empty specstop cache (``$SPECSTOP_CACHE``) for this test."""
    from specstop.paths import CACHE_ENV

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return cache


@pytest.fixture
def shared_dataset():
    """``shared_dataset("mbpp.jsonl")`` -> path of a file in ../shared/datasets (skip if absent)."""

    def get(name: str) -> Path:
        path = SHARED_DATASETS / name
        if not path.is_file():
            pytest.skip(f"shared dataset {name} not available at {path}")
        return path

    return get


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """Synthetic dataset with hidden states (H=16), mixed rows and rollouts (48 x 64 train tokens)."""
    from specstop.testing import write_synthetic_dataset

    return write_synthetic_dataset(
        tmp_path_factory.mktemp("synth") / "data",
        {"train": 48, "validation": 12, "test": 6},
        64,
        hidden_size=16,
        with_mixed=True,
        with_rollouts=True,
        seed=1,
    )


@pytest.fixture(scope="module")
def pair():
    """A tiny random draft/target pair in memory (one per test module; a module may define its own)."""
    from specstop.testing import tiny_pair

    return tiny_pair()


@pytest.fixture(scope="module")
def exports(tmp_path_factory, pair):
    """Random-init disco_ffn and specdecpp_resnet export folders for :func:`pair` (``{name: folder}``)."""
    from _export_fixtures import random_exports

    return random_exports(tmp_path_factory.mktemp("exports"), pair)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache that every hub lookup of this test uses, offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache
