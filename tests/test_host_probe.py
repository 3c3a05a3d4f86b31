"""The host probe: a fixed workload timed, and the words for a run whose host changed speed under it."""

from specstop.measure.host_probe import KINDS, drift, drift_line, probe


def test_the_probe_times_both_workloads():
    figures = probe(stream_mib=16, gemm_rows=8, repeats=2)
    assert set(figures) == set(KINDS) and all(v > 0 for v in figures.values())


def test_drift_is_the_spread_of_each_workload_over_a_runs_probes():
    probes = [{"when": "a", "stream_ms": 20.0, "gemm_ms": 10.0}, {"when": "b", "stream_ms": 30.0, "gemm_ms": 10.5},
              {"when": "c", "stream_ms": 25.0}]
    moved = drift(probes)
    assert moved["stream_ms"] == {"min": 20.0, "max": 30.0, "spread": 0.5}
    assert moved["gemm_ms"] == {"min": 10.0, "max": 10.5, "spread": 0.05}
    assert drift([]) == {}


def test_a_run_is_called_not_comparable_only_past_the_limit():
    steady = [{"stream_ms": 20.0, "gemm_ms": 10.0}, {"stream_ms": 23.0, "gemm_ms": 11.0}]
    assert drift_line(steady, limit=0.2) is None
    line = drift_line(steady + [{"stream_ms": 31.0, "gemm_ms": 10.0}], limit=0.2)
    # only the workload that moved is named, with its range
    assert line is not None and "stream 20.0-31.0 ms (+55%)" in line and "gemm" not in line
    assert "\n" not in line
