"""PEARL with the draft and the target in parallel worker processes: greedy equality with the target,
sampling by chi-square, the ablations, clean shutdown (worker error, worker killed, Ctrl-C), CLI."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import test_decoder as chain_tests
import test_decoder_sampling as sampling_tests
import torch
from _export_fixtures import single_thread  # noqa: F401

from specstop.decode import PearlDecoder, PearlSpec, PearlWorkers, WorkerError, parse_pearl_policy
from specstop.decode import pearl_workers as workers_mod
from specstop.decode.pearl_spec import split_cores
from specstop.decode.pearl_timing import time_split
from specstop.errors import UserError
from specstop.probs import logits_to_probs

# The chain decoder's fixtures: the same tiny pairs, prompts and target references.
pair, prompts, references, MAX_NEW = chain_tests.pair, chain_tests.prompts, chain_tests.references, chain_tests.MAX_NEW
small_pair, DECODING, PROMPT, VOCAB = (
    sampling_tests.small_pair, sampling_tests.DECODING, sampling_tests.PROMPT, sampling_tests.VOCAB
)
SHM = Path("/dev/shm")
SPECS = [PearlSpec(1), PearlSpec(3), PearlSpec(5), PearlSpec(3, pre_verify=False), PearlSpec(3, post_verify=False),
         PearlSpec(2, pre_verify=False, post_verify=False)]


def _cores():
    """Two disjoint cores where there are two; a one-core machine pins both workers to its core."""
    cores = sorted(os.sched_getaffinity(0))
    return split_cores(None, cores) if len(cores) > 1 else (cores, cores)


def _shm_entries() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def _assert_clean(pids: list[int], shm_before: set[str]) -> None:
    """No worker process left (not even a zombie) and nothing of ours left in /dev/shm."""
    active = {p.pid for p in multiprocessing.active_children()}  # also reaps finished children
    for pid in pids:
        assert pid not in active and not Path(f"/proc/{pid}").exists(), f"worker {pid} is still alive"
    new = {n for n in _shm_entries() - shm_before if n.startswith(("specstop-pearl", "torch_"))}
    assert not new, f"left in /dev/shm: {sorted(new)}"


@pytest.fixture(scope="module")
def workers(pair):
    with PearlWorkers(pair, _cores(), backend="processes") as w:
        yield w


@pytest.fixture(scope="module")
def sampling_workers(small_pair):
    with PearlWorkers(small_pair, _cores(), backend="processes") as w:
        yield w


# ---------------------------------------------------------------- specs
@pytest.mark.parametrize("text, expected", [("pearl", PearlSpec()), ("pearl:4", PearlSpec(4)), ("static:4", None),
                                            ("tree:8", None)])
def test_parse_pearl_policy(text, expected):
    assert parse_pearl_policy(text) == expected


@pytest.mark.parametrize("text, fragment", [("pearl:x", "whole number"), ("pearl:0", "between 1 and"),
                                            ("pearl:", "whole number"), ("pearl:1000", "between 1 and")])
def test_malformed_pearl_policy_is_one_line(text, fragment):
    with pytest.raises(UserError, match=fragment) as err:
        parse_pearl_policy(text)
    assert "\n" not in str(err.value)


def test_core_split():
    assert split_cores(None, [0, 1]) == ([0], [1])
    assert split_cores(None, list(range(8))) == ([0, 1], [2, 3, 4, 5, 6, 7])
    assert split_cores("1,2", [4, 5, 6, 7]) == ([4], [5, 6])
    for text, fragment in [("3,2", "asks for 5 cores"), ("0,2", "at least one core"), ("1", "expected D,T")]:
        with pytest.raises(UserError, match=fragment):
            split_cores(text, [0, 1, 2, 3])
    with pytest.raises(UserError, match="needs 2\\+ CPU cores"):
        split_cores(None, [0])


# ---------------------------------------------------------------- greedy: the target's own output
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_greedy_pearl_equals_target(spec, pair, prompts, references, workers):
    dec = PearlDecoder(pair, spec, workers=workers)
    for ids, ref in zip(prompts, references):
        res = dec.generate(ids, MAX_NEW)
        assert res.token_ids == ref, f"{spec.label}: PEARL output differs from the target's greedy output"
        c = res.counters
        assert c["N"] == len(ref) and c["rounds"] == len(res.round_lengths) == len(res.timings["round_seconds"])
        assert c["N_discarded"] == c["N_draft"] - sum(res.accepted_per_round) >= 0
        assert c["rounds"] == sum(c[k] for k in ("pre_verify_phases", "post_verify_phases", "draft_only_phases",
                                                 "target_only_phases"))
        assert c["N_target"] == c["rounds"] - c["draft_only_phases"]
        assert (c["pre_verify_phases"] > 0) == spec.pre_verify and (c["draft_only_phases"] > 0) != spec.pre_verify
        assert set(res.timings) >= {"prefill", "draft", "target", "accept", "sync", "total", "round_seconds"}
    assert workers.describe()["draft"]["cores"] != workers.describe()["target"]["cores"] or len(_cores()[0]) == 1


def test_post_verify_grows_the_window(pair, prompts, workers):
    """With post-verify a block keeps growing while it is accepted: some phase accepts more than gamma
    tokens in a row across phases, and post-verify phases follow each other."""
    res = PearlDecoder(pair, PearlSpec(2), workers=workers).generate(prompts[0], MAX_NEW)
    c = res.counters
    assert c["post_verify_phases"] > 0 and c["pre_verify_phases"] > 0
    assert max(res.accepted_per_round) >= 2  # a whole post-verify block plus the next window's first token


@pytest.mark.parametrize("max_new", [1, 2, 5])
def test_length_cap_and_target_only(max_new, pair, prompts, references, workers):
    dec = PearlDecoder(pair, PearlSpec(4), workers=workers)
    res = dec.generate(prompts[1], max_new)
    assert res.token_ids == references[1][:max_new]
    base = dec.generate(prompts[1], max_new, max_draft=0)
    assert base.token_ids == references[1][:max_new] and base.counters["N_draft"] == 0
    assert base.counters["target_only_phases"] == base.counters["rounds"] == max_new
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], 3)


def test_threads_backend_matches(pair, prompts, references):
    """The threads variant (CUDA streams; here CPU threads) runs the same coordinator."""
    with PearlDecoder(pair, PearlSpec(3), backend="threads") as dec:
        assert dec.generate(prompts[0], MAX_NEW).token_ids == references[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_equal_target(prompts):
    """CUDA: two threads on two streams (or the draft on a second GPU) give the target's greedy output."""
    from specstop.testing import tiny_pair

    cuda_pair = tiny_pair()
    cuda_pair.draft.cuda()
    cuda_pair.target.cuda()
    padded = list(range(cuda_pair.vocab_size, cuda_pair.target.config.vocab_size))
    ids = prompts[0]
    ref = cuda_pair.target.generate(torch.tensor([ids], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False,
                                    suppress_tokens=padded)[0, len(ids):].tolist()
    with PearlDecoder(cuda_pair, PearlSpec(3)) as dec:
        assert dec.workers.backend == "threads"
        assert dec.generate(ids, MAX_NEW).token_ids == ref


# ---------------------------------------------------------------- sampling: the target's distribution
@pytest.mark.parametrize(
    "spec, max_new",
    # gamma 1 / 4 tokens: the second token comes from a post-verify phase's parallel draft (z_1) or
    # its residual; no-pre-verify verifies a whole drafted window; no-post-verify ends on a bonus.
    [(PearlSpec(1), 4), (PearlSpec(2, pre_verify=False), 4), (PearlSpec(2, post_verify=False), 3)],
    ids=lambda v: v.label if isinstance(v, PearlSpec) else str(v),
)
def test_sampled_pearl_follows_the_target(spec, max_new, small_pair, sampling_workers):
    from scipy.stats import chi2

    @torch.no_grad()
    def probs(ids):
        return logits_to_probs(small_pair.target(torch.tensor([ids])).logits[0], DECODING, VOCAB)

    p1 = probs(PROMPT)[-1]
    exact = {}
    for a in range(VOCAB):
        p2 = probs(PROMPT + [a])[-1]
        for b in range(VOCAB):
            exact[(a, b)] = float(p1[a] * p2[b])
    runs = 500
    counts = dict.fromkeys(exact, 0)
    dec = PearlDecoder(small_pair, spec, DECODING, workers=sampling_workers).start()
    rejections = 0
    for seed in range(runs):
        res = dec.generate(PROMPT, max_new, seed=seed)
        counts[tuple(res.token_ids[:2])] += 1
        rejections += sum(n < k for k, n in zip(res.round_lengths, res.accepted_per_round))
    assert rejections > runs * 0.2, "the draft must be rejected often for the test to mean anything"
    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell in sorted(exact, key=exact.get):
        pool_obs += counts[cell]
        pool_exp += exact[cell] * runs
        if pool_exp >= 5:
            stat += (pool_obs - pool_exp) ** 2 / pool_exp
            df += 1
            pool_obs, pool_exp = 0, 0.0
    pvalue = chi2.sf(stat, df)
    assert pvalue > 1e-3, f"{spec.label}: chi-square {stat:.1f} on {df} df (p={pvalue:.2g}): not the target's distribution"


def test_sampling_is_reproducible(small_pair, sampling_workers):
    dec = PearlDecoder(small_pair, PearlSpec(2), DECODING, workers=sampling_workers)
    assert dec.generate(PROMPT, 6, seed=3).token_ids == dec.generate(PROMPT, 6, seed=3).token_ids


# ---------------------------------------------------------------- clean shutdown
@pytest.fixture
def own_decoder(pair):
    """A decoder with its own workers (the tests below end them)."""
    dec = PearlDecoder(pair, PearlSpec(3), cores=_cores())
    yield dec
    dec.close()


def _interrupt_after(monkeypatch, calls: int, action) -> None:
    """Run ``action(pids)`` just before the coordinator's ``calls``-th wait for a worker result."""
    real = workers_mod._ProcessWorker.result
    seen = {"n": 0}

    def result(self):
        seen["n"] += 1
        if seen["n"] == calls:
            action()
        return real(self)

    monkeypatch.setattr(workers_mod._ProcessWorker, "result", result)


def test_worker_error_shuts_everything_down(own_decoder, prompts):
    before = _shm_entries()
    own_decoder.start()
    pids = own_decoder.workers.pids()
    assert len(pids) == 2 and all(Path(f"/proc/{p}").exists() for p in pids)
    with pytest.raises(WorkerError, match="worker failed: IndexError"):
        own_decoder.generate(prompts[0][:3] + [10**6] + prompts[0][3:], 8)  # no such token: the forward fails
    _assert_clean(pids, before)
    assert not own_decoder.workers.started


def test_killed_worker_shuts_everything_down(own_decoder, prompts, monkeypatch):
    before = _shm_entries()
    own_decoder.start()
    pids = own_decoder.workers.pids()
    _interrupt_after(monkeypatch, 6, lambda: os.kill(pids[1], signal.SIGKILL))
    with pytest.raises(WorkerError, match="target worker died .*signal 9"):
        own_decoder.generate(prompts[0], MAX_NEW)
    _assert_clean(pids, before)


def test_ctrl_c_shuts_everything_down_and_restarts(own_decoder, prompts, references, monkeypatch):
    before = _shm_entries()
    own_decoder.start()
    pids = own_decoder.workers.pids()

    def ctrl_c():
        # A terminal sends SIGINT to the whole foreground process group; the workers ignore it and the
        # parent gets a KeyboardInterrupt in the middle of waiting for a result.
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        raise KeyboardInterrupt

    _interrupt_after(monkeypatch, 6, ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        own_decoder.generate(prompts[0], MAX_NEW)
    _assert_clean(pids, before)
    monkeypatch.undo()
    res = own_decoder.generate(prompts[0], MAX_NEW)  # new workers
    new_pids = own_decoder.workers.pids()
    assert res.token_ids == references[0] and len(new_pids) == 2 and set(new_pids).isdisjoint(pids)
    own_decoder.close()
    _assert_clean(new_pids, before)


# ---------------------------------------------------------------- pricing the split
def test_time_split_reports_alone_and_beside(workers):
    t = time_split(workers, target_tokens=2, context=8, reps=3)
    for key in ("draft_alone_s", "target_alone_s", "draft_beside_target_s", "target_beside_draft_s"):
        assert t[key] > 0
    assert t["gamma_alone"] >= 1 and t["gamma_beside"] >= 1 and t["workers"]["backend"] == "processes"


# ---------------------------------------------------------------- CLI
def test_decode_cli_pearl(tiny_pair_dir, capsys):
    from specstop.cli import main

    base = ["decode", "--pair", str(tiny_pair_dir), "--prompt", "hi", "--max-new-tokens", "8", "--dtype", "float32",
            "--device", "cpu"]
    assert main(base + ["--policy", "pearl", "--cost-model", "llama2-7b-70b", "--pearl-no-post-verify", "--json"]) == 0
    captured = capsys.readouterr()
    obj = json.loads(captured.out.strip().splitlines()[-1])
    assert obj["counters"]["N"] == len(obj["token_ids"]) <= 8
    assert obj["counters"]["policy"].startswith("pearl:") and "no-post-verify" in obj["counters"]["policy"]
    assert "from cost model llama2-7b-70b" in captured.err
    for extra, fragment in [
        (["--policy", "pearl:two"], "whole number"),
        (["--policy", "pearl:3", "--cost-model", "llama2-7b-70b"], "fixes the window"),
        (["--policy", "static:3", "--pearl-cores", "1,1"], "read by --policy pearl only"),
        (["--policy", "pearl", "--pearl-cores", "8,8"], "asks for 16 cores"),
        (["--policy", "pearl:2", "--static-cache"], "drop --static-cache"),
    ]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
