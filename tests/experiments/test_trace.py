"""experiments/trace.py: the profiler summary (busy time, span, top kernels) and the --trace flags."""

import json
from types import SimpleNamespace as NS

import pytest

from experiments.trace import union_length, device_trace, summarize_plane, trace_on_backend


def _event(name, start, duration):
    return NS(name=name, start_ns=start, duration_ns=duration)


def test_union_length_merges_overlaps_and_keeps_gaps():
    assert union_length([]) == 0
    assert union_length([(0, 10)]) == 10
    assert union_length([(0, 10), (5, 15), (20, 30)]) == 25  # [0, 15) + [20, 30)
    assert union_length([(20, 30), (0, 10), (10, 12)]) == 22  # unsorted, touching
    assert union_length([(0, 100), (10, 20), (30, 40)]) == 100  # nested


def test_summarize_plane_counts_kernel_lines_only():
    plane = NS(name="/device:GPU:0", lines=[
        NS(name="XLA Modules", events=[_event("jit_loop", 0, 1000), _event("jit_loop", 2000, 500)]),
        NS(name="XLA Ops", events=[_event("fusion.1", 0, 900)]),  # describes kernels: not counted twice
        NS(name="Stream #1(Compute)", events=[_event("gemm", 0, 300), _event("fusion_7", 400, 100),
                                              _event("gemm", 2000, 300)]),
        NS(name="Stream #2(MemcpyD2D)", events=[_event("memcpy", 200, 300), _event("zero", 600, 0)]),
    ])
    out = summarize_plane(plane)
    assert out["busy_s"] == pytest.approx(800e-9)  # [0, 500) + [2000, 2300)
    assert out["span_s"] == pytest.approx(2300e-9)
    assert out["kernel_time_s"] == pytest.approx(1000e-9)
    assert out["launches"] == 4 and out["distinct_kernels"] == 3  # the zero-length event is dropped
    assert out["top_kernels"][0] == {"name": "gemm", "total_s": pytest.approx(600e-9), "count": 2}
    assert out["modules"] == [{"name": "jit_loop", "total_s": pytest.approx(1500e-9), "count": 2}]
    assert out["lines"][0] == "XLA Modules"


def test_device_trace_reads_a_real_cpu_trace():
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    summary = trace_on_backend(lambda: [f(x).block_until_ready() for _ in range(3)])
    assert summary["wall_s"] > 0 and summary["backend"] == "cpu"
    (plane,) = summary["planes"].values()
    assert plane["launches"] > 0 and plane["busy_s"] > 0
    assert plane["busy_s"] <= plane["span_s"] + 1e-9
    # a prefix that matches nothing gives no planes rather than a wrong one
    assert device_trace(lambda: f(x).block_until_ready(), prefixes=("/device:TPU",))["planes"] == {}


def test_dustin_speed_trace_flag(tmp_path):
    from experiments.run import main
    from tests.conftest import DUSTIN_SPEED_ARGS as ARGS

    out = tmp_path / "speed.json"
    assert main(ARGS + ["--methods", "ar,dustin", "--trace", "--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["ctx320/b2"]
    for method in ("ar", "dustin"):
        trace = case[method]["trace"]
        assert trace["wall_s"] > 0 and trace["planes"]
        assert all(p["launches"] > 0 for p in trace["planes"].values())


def test_knapspec_trace_flag(tmp_path):
    from experiments.run import main

    out = tmp_path / "ks.json"
    argv = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "3", "--contexts", "64",
            "--max-new-tokens", "16", "--gamma-max", "2", "--gamma-buckets", "1", "--batches", "1",
            "--methods", "knapspec", "--candidate-plans", "0", "--plan-cost-repeats", "0", "--device-tag", "test",
            "--trace", "--out", str(out)]
    assert main(argv) == 0
    case = json.loads(out.read_text())["cases"]["test/summarize/ctx64/b1/knapspec"]
    assert set(case["trace"]) == {"ar", "knapspec"}
    for trace in case["trace"].values():
        assert trace["wall_s"] > 0 and all(p["launches"] > 0 for p in trace["planes"].values())


def test_trace_or_error_keeps_going(capsys):
    from experiments.trace import trace_or_error

    out = trace_or_error(lambda: 1 / 0, "[test] trace")
    assert set(out) == {"error"} and "ZeroDivisionError" in out["error"]
    assert "[test] trace failed" in capsys.readouterr().err
