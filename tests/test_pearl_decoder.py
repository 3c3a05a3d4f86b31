"""PEARL with the draft and the target in parallel worker processes: greedy equality with the target,
sampling by chi-square, the ablations, stopping policies inside windows, clean shutdown (worker error,
worker killed, Ctrl-C, SIGTERM, the parent killed), CLI."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import test_decoder as chain_tests
import test_decoder_sampling as sampling_tests
import torch
from _export_fixtures import single_thread  # noqa: F401

from specstop.decode import PearlDecoder, PearlSpec, PearlWorkers, WorkerError, parse_pearl_policy
from specstop.decode import pearl_workers as workers_mod
from specstop.decode.chain import SpeculativeDecoder
from specstop.decode.pearl_server import load_stop_policy
from specstop.decode.pearl_spec import split_cores
from specstop.decode.pearl_timing import time_split
from specstop.errors import UserError
from specstop.policy import PolicySpec
from specstop.testing import pooled_chi_square, two_token_distribution

# The chain decoder's fixtures: the same tiny pairs, prompts and target references.
# `pair` and `exports` (random-init disco_ffn and specdecpp_resnet): tests/conftest.py
prompts, references, MAX_NEW = chain_tests.prompts, chain_tests.references, chain_tests.MAX_NEW
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


# ---------------------------------------------------------------- stopping policies inside windows
def _stop_arg(name, exports):
    return str(exports[name]) if name in exports else name


@pytest.mark.parametrize("stop", ["confidence:0.4", "static:2", "disco", "sdpp"])
def test_greedy_pearl_with_stop_policy_equals_target(stop, pair, prompts, references, exports, workers):
    """A stopping policy ends windows early (the learned exports and the rules both stop and continue on
    the tiny pair) and the output is still the target's greedy output."""
    dec = PearlDecoder(pair, PearlSpec(5, stop=_stop_arg(stop, exports)), workers=workers)
    stopped = 0
    for ids, ref in zip(prompts, references):
        res = dec.generate(ids, MAX_NEW)
        assert res.token_ids == ref, f"{dec.label}: PEARL output differs from the target's greedy output"
        assert res.counters["policy"].startswith("pearl:5+")
        stopped += res.counters["stopped_windows"]
    assert stopped > 0, f"{stop} never ended a window early: the test would not exercise it"
    if stop in exports:
        assert "+" in dec.label and str(exports[stop]) not in dec.label  # the export's name, not its path


@pytest.mark.parametrize("stop", ["confidence:0.05", "disco", "sdpp"])
def test_stop_policy_decides_as_in_the_chain_decoder(stop, pair, prompts, exports, workers):
    """Without pre- and post-verify, PEARL is draft-a-window-then-verify: with gamma at the policy's own cap
    its windows are the chain decoder's rounds, so the policy - run in the draft's worker - sees the same
    q_j, hidden states and positions and makes the same decisions."""
    policy = chain_tests.make_policy(stop, exports, pair)
    dec = PearlDecoder(pair, PearlSpec(policy.cap(), False, False, stop=_stop_arg(stop, exports)), workers=workers)
    for ids in prompts:
        res = dec.generate(ids, MAX_NEW)
        chain = SpeculativeDecoder(pair, chain_tests.make_policy(stop, exports, pair)).generate(ids, MAX_NEW)
        assert res.token_ids == chain.token_ids
        assert [k for k in res.round_lengths if k] == [k for k in chain.round_lengths if k], stop


def test_stop_policy_is_refused_in_one_line(pair, exports):
    for stop, fragment in [("heuristic", "grows and shrinks"), ("bogus:1", "unknown policy"),
                           ("confidence:2", "0 < TAU <= 1"), ("mcsd:2,2", "'mcsd:2,2' is a token-tree policy"),
                           ("pearl:3", "is a parallel \\(PEARL\\) policy"),
                           (PolicySpec(kind="predictor", family="disco_ffn"), "give its export folder")]:
        with pytest.raises(UserError, match=fragment) as err:
            PearlDecoder(pair, PearlSpec(3, stop=stop))
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="hidden size is 3"):
        load_stop_policy(str(exports["sdpp"]), allow_draft_mismatch=True, hidden_size=3)
    # A tuned rule's spec (not expressible as confidence:TAU: its own SL_max) crosses as a spec.
    spec = PolicySpec(kind="confidence", threshold=0.3, sl_max=2)
    assert PearlSpec(4, stop=spec).label == "pearl:4+confidence:0.3"
    assert load_stop_policy(spec).cap() == 2


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
    with PearlDecoder(pair, PearlSpec(3, stop="confidence:0.4"), backend="threads") as dec:
        res = dec.generate(prompts[0], MAX_NEW)
        assert res.token_ids == references[0] and res.counters["stopped_windows"] > 0


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
        dec.workers.busy(clear=True)
        assert dec.generate(ids, MAX_NEW).token_ids == ref
        busy = dec.workers.busy()
    # The two streams had work in flight together (events on each stream): a serial worker gives 0.
    assert busy["both_s"] > 0, busy


def test_threads_overlap_and_a_serial_worker_does_not(pair, prompts, references, monkeypatch):
    """Equal output cannot tell concurrent workers from serial ones; their busy intervals can."""
    with PearlDecoder(pair, PearlSpec(3), backend="threads") as dec:
        assert dec.generate(prompts[0], MAX_NEW).token_ids == references[0]
        busy = dec.workers.busy()
    assert busy["both_s"] > 0 and busy["draft_s"] > 0 and busy["target_s"] > 0, busy

    def serial_submit(self, op, *args):  # runs each op to its end before the coordinator goes on
        self.busy.begin()
        out = getattr(self.server, op)(*args)
        self.busy.end()
        self.outbox.put(("ok", out))

    monkeypatch.setattr(workers_mod._ThreadWorker, "submit", serial_submit)
    with PearlDecoder(pair, PearlSpec(3), backend="threads") as dec:
        assert dec.generate(prompts[0], MAX_NEW).token_ids == references[0]
        serial = dec.workers.busy()
    assert serial["both_s"] == 0 and serial["draft_s"] > 0 and serial["target_s"] > 0, serial


def test_busy_overlap_matches_a_brute_force_count():
    from specstop.decode.busy_trace import busy_overlap

    rng = np.random.default_rng(0)
    for _ in range(50):
        a = [tuple(sorted(rng.integers(0, 200, 2))) for _ in range(rng.integers(0, 6))]
        b = [tuple(sorted(rng.integers(0, 200, 2))) for _ in range(rng.integers(0, 6))]
        grid = np.zeros((2, 200), dtype=bool)  # unit cells [t, t+1)
        for row, ivs in enumerate((a, b)):
            for s, e in ivs:
                grid[row, s:e] = True
        got = busy_overlap([(float(s), float(e)) for s, e in a], [(float(s), float(e)) for s, e in b])
        assert got == {"first_s": grid[0].sum(), "second_s": grid[1].sum(), "both_s": (grid[0] & grid[1]).sum()}


# ---------------------------------------------------------------- sampling: the target's distribution
@pytest.mark.parametrize(
    "spec, max_new",
    # gamma 1 / 4 tokens: the second token comes from a post-verify phase's parallel draft (z_1) or
    # its residual; no-pre-verify verifies a whole drafted window; no-post-verify ends on a bonus.
    # With a stopping policy (sampling: it reads q_j(y_j)), windows end early at random.
    [(PearlSpec(1), 4), (PearlSpec(2, pre_verify=False), 4), (PearlSpec(2, post_verify=False), 3),
     (PearlSpec(3, stop="confidence:0.5"), 4)],
    ids=lambda v: v.label if isinstance(v, PearlSpec) else str(v),
)
def test_sampled_pearl_follows_the_target(spec, max_new, small_pair, sampling_workers):
    exact = two_token_distribution(small_pair.target, PROMPT, DECODING, VOCAB)
    runs = 500
    counts = dict.fromkeys(exact, 0)
    dec = PearlDecoder(small_pair, spec, DECODING, workers=sampling_workers).start()
    rejections = stopped = 0
    for seed in range(runs):
        res = dec.generate(PROMPT, max_new, seed=seed)
        counts[tuple(res.token_ids[:2])] += 1
        rejections += sum(n < k for k, n in zip(res.round_lengths, res.accepted_per_round))
        stopped += res.counters["stopped_windows"]
    assert rejections > runs * 0.2, "the draft must be rejected often for the test to mean anything"
    assert (stopped > runs * 0.1) == (spec.stop is not None), "the stopping policy must end windows early"
    stat, df, pvalue = pooled_chi_square(counts, exact, runs)
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


def test_worker_error_shuts_everything_down(own_decoder, prompts, monkeypatch):
    from specstop.decode import pearl

    before = _shm_entries()
    own_decoder.start()
    pids = own_decoder.workers.pids()
    assert len(pids) == 2 and all(Path(f"/proc/{p}").exists() for p in pids)
    # generate refuses such a prompt up front; let it through, so a worker's forward fails
    monkeypatch.setattr(pearl, "check_request", lambda pair, ids, n, **kw: list(ids))
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


# A decode in its own process: the worker processes inherit MARK through the environment, so the test
# finds every process the run started even after the parent is gone.
_DECODE_SCRIPT = textwrap.dedent("""
    import sys

    import torch

    from specstop.decode import PearlDecoder, PearlSpec
    from specstop.testing import tiny_pair

    if __name__ == "__main__":
        torch.set_num_threads(1)
        draft_cores, target_cores = ([int(c) for c in part.split(",")] for part in sys.argv[1].split(";"))
        dec = PearlDecoder(tiny_pair(), PearlSpec(3, stop="confidence:0.05"), cores=(draft_cores, target_cores))
        print("starting", flush=True)
        dec.start()
        while True:
            dec.generate([1, 2, 3, 4], 24)
            print("decoded", flush=True)
""")
MARK = "SPECSTOP_PEARL_TEST_RUN"


def _processes_marked(mark: str) -> list[int]:
    """Live processes (zombies excluded) whose environment carries ``MARK=mark``."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0") and " Z " not in (proc / "stat").read_text():
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


#: The traceback of a spawned child whose parent died while writing its start data (Python's own).
_SPAWN_CUT_SHORT = re.compile(r"Traceback \(most recent call last\):\n(?:[ ].*\n)*?[ ].*spawn_main.*\n(?:[ ].*\n)*"
                              r"EOFError: Ran out of input\n?")


def _holds_weights(pid: int) -> bool:
    """Does process ``pid`` hold PEARL's shared weights: a memfd of ours, or (no memfd) its /dev/shm folder?"""
    try:
        links = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        links = []
    return (any(link.startswith("/memfd:specstop-pearl-") for link in links)
            or any(n.startswith(f"specstop-pearl-{pid}-") for n in _shm_entries()))


@pytest.mark.parametrize("when, sig", [("decoded", signal.SIGTERM), ("starting", signal.SIGTERM),
                                       ("decoded", signal.SIGKILL), ("starting", signal.SIGKILL)],
                         ids=["sigterm-mid-decode", "sigterm-during-startup", "sigkill-parent-mid-decode",
                              "sigkill-parent-during-startup"])
def test_signal_to_the_decoding_process_leaves_nothing_behind(when, sig, tmp_path):
    """SIGTERM mid-decode or while the workers start (the weights shared): the parent exits with 143
    after the Ctrl-C cleanup. SIGKILL (no cleanup possible in the parent), even while the workers start:
    the workers notice the parent is gone and exit on their own, and the weights were never a named file
    (memfd), so no run is needed to sweep them. Either way no worker survives and nothing of the run
    is left in /dev/shm."""
    script = tmp_path / "decode.py"
    script.write_text(_DECODE_SCRIPT)
    shm_before = _shm_entries()
    mark = uuid.uuid4().hex
    cores = ";".join(",".join(map(str, c)) for c in _cores())
    env = {**os.environ, MARK: mark}
    proc = subprocess.Popen([sys.executable, str(script), cores], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        for line in proc.stdout:
            if line.strip() == when:
                break
        else:
            pytest.fail(f"the decode ended before {when!r}: {proc.wait()} {proc.stderr.read()[-2000:]}")
        if when == "starting":
            # The signal while the parent holds the shared weights (saved, or being loaded by the workers).
            deadline = time.monotonic() + 30
            while not _holds_weights(proc.pid):
                assert time.monotonic() < deadline and proc.poll() is None, "the run never shared its weights"
                time.sleep(0.02)
        else:
            assert len(_processes_marked(mark)) >= 3  # the parent, its two workers (and multiprocessing's tracker)
        os.kill(proc.pid, sig)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert rc == (143 if sig == signal.SIGTERM else -signal.SIGKILL), stderr[-2000:]
    if sig == signal.SIGKILL:
        # A SIGKILL that lands inside a worker's spawn cuts the start data the child reads before any of
        # our code runs: Python's spawn_main prints that EOFError and the child exits. Nothing else may.
        stderr = _SPAWN_CUT_SHORT.sub("", stderr)
    assert "Traceback" not in stderr, stderr[-2000:]
    deadline = time.monotonic() + 15  # the workers' watchdog polls twice a second; closing waits for a forward
    while _processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_marked(mark), "worker processes outlived the decoding process"
    left = [n for n in _shm_entries() - shm_before if n.startswith(("specstop-pearl", "torch_"))]
    assert not left, f"left in /dev/shm: {left}"


def test_sigterm_handler_is_held_while_workers_run(workers, monkeypatch):
    """PEARL's SIGTERM handler is installed while any pool runs (counted), the previous one comes back
    after the last, and a handler someone else installed is left alone."""
    assert signal.getsignal(signal.SIGTERM) is workers_mod._on_sigterm  # the module's pool is running
    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(workers_mod, "_term", {"pools": 0, "previous": None, "defer": 0, "pending": False})
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert workers_mod._hold_sigterm() and workers_mod._hold_sigterm()
        assert signal.getsignal(signal.SIGTERM) is workers_mod._on_sigterm
        workers_mod._release_sigterm()
        assert signal.getsignal(signal.SIGTERM) is workers_mod._on_sigterm  # one pool still runs
        workers_mod._release_sigterm()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        def theirs(signum, frame):
            pass

        signal.signal(signal.SIGTERM, theirs)
        assert not workers_mod._hold_sigterm() and signal.getsignal(signal.SIGTERM) is theirs
        with pytest.raises(SystemExit) as exc:  # what the handler does: unwind like Ctrl-C, exit 143
            workers_mod._on_sigterm(signal.SIGTERM, None)
        assert exc.value.code == 143
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    assert main(base + ["--policy", "pearl:3", "--stop", "static:2", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert obj["counters"]["policy"] == "pearl:3+static:2" and obj["counters"]["N"] == len(obj["token_ids"])
    for extra, fragment in [
        (["--policy", "static:3", "--stop", "confidence:0.5"], "read by --policy pearl only"),
        (["--policy", "pearl:3", "--stop", "heuristic"], "grows and shrinks"),
        (["--policy", "pearl:3", "--stop", "confidence:x"], "TAU must be a number"),
        (["--policy", "pearl:two"], "whole number"),
        (["--policy", "pearl:3", "--cost-model", "llama2-7b-70b"], "fixes the window"),
        (["--policy", "static:3", "--pearl-cores", "1,1"], "read by --policy pearl only"),
        (["--policy", "pearl", "--pearl-cores", "8,8"], "asks for 16 cores"),
        (["--policy", "pearl:2", "--static-cache"], "drop --static-cache"),
    ]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
