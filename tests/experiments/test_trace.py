"""experiments/trace.py: the profiler summary (busy time, span, top kernels) and the --trace flags."""

import json
from types import SimpleNamespace as NS

import pytest

from experiments.trace import (annotation_spans, device_trace, op_names, phase_of, summarize_phases, summarize_plane,
                               summarize_windows, trace_on_backend, union_length)


def _event(name, start, duration, **stats):
    return NS(name=name, start_ns=start, duration_ns=duration, stats=list(stats.items()))


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


def test_windows_attribute_device_work_to_annotated_host_spans():
    """A jaxspec.* annotation on a host plane is a window: its spans' wall time, the device plane's busy time
    clipped to them, and the kernels that started inside them; other annotations and device planes' own
    events are not windows."""
    host = NS(name="/host:CPU", lines=[NS(name="python", events=[
        _event("jaxspec.a", 0, 1000), _event("jaxspec.a", 3000, 500), _event("other.b", 0, 5000),
        _event("jaxspec.empty", 4000, 0)])])
    device = NS(name="/device:GPU:0", lines=[
        NS(name="XLA Ops", events=[_event("jaxspec.not-a-window", 0, 4000)]),
        NS(name="Stream #1(Compute)", events=[_event("k1", 100, 200), _event("k2", 900, 300), _event("k3", 2000, 500),
                                              _event("k4", 3100, 100)])])
    spans = annotation_spans([host, device])
    assert spans == {"jaxspec.a": [(0, 1000), (3000, 3500)]}
    out = summarize_windows(device, spans)["jaxspec.a"]
    assert out["count"] == 2 and out["wall_s"] == pytest.approx(1500e-9)
    assert out["busy_s"] == pytest.approx(400e-9)  # k1 200 + k2's first 100 + k4 100; k3 is outside
    assert out["launches"] == 3 and out["idle_share"] == pytest.approx(1 - 400 / 1500)


def test_phases_attribute_kernels_by_their_hlo_op_scope():
    """Each kernel event's hlo_op stat, through the compiled text's op_name metadata, to the innermost phase of
    its scope path; ops under no phase are 'other', events without a known op 'unattributed'."""
    text = "\n".join([
        '  %fusion.1 = f32[2]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(f)/while/body/draft/layer0/mul"}',
        '  ROOT %gemm.2 = f32[2]{0} custom-call(%a), metadata={op_name="jit(f)/while/body/verification/selection/dot"}',
        '  %copy.3 = f32[2]{0} copy(%b), metadata={op_name="jit(f)/while/body/verification/layer1/dot_general"}',
        '  %tuple.4 = (f32[2]{0}) tuple(%c)',  # no metadata: not listed
        '  %add.5 = f32[2]{0} add(%d, %e), metadata={op_name="jit(f)/while/cond/lt" source_file="x.py"}'])
    names = op_names(text)
    assert names == {"fusion.1": "jit(f)/while/body/draft/layer0/mul",
                     "gemm.2": "jit(f)/while/body/verification/selection/dot",
                     "copy.3": "jit(f)/while/body/verification/layer1/dot_general", "add.5": "jit(f)/while/cond/lt"}
    phases = ("draft", "verification", "selection", "commit")
    assert phase_of(names["gemm.2"], phases) == "selection"  # the innermost phase wins
    assert phase_of(names["copy.3"], phases) == "verification"
    assert phase_of(names["add.5"], phases) == "other"
    assert phase_of("jit(f)/drafted/x", phases) == "other"  # whole path components only
    plane = NS(name="/device:GPU:0", lines=[
        NS(name="XLA Ops", events=[_event("fusion.1", 0, 5000, hlo_op="fusion.1")]),  # not a kernel line
        NS(name="Stream #1(Compute)", events=[
            _event("k_draft", 0, 100, hlo_op="fusion.1"), _event("k_draft", 50, 100, hlo_op="fusion.1"),
            _event("nvjet_x", 200, 300, hlo_op="gemm.2"), _event("k_verify", 600, 100, hlo_op="copy.3"),
            _event("k_cond", 800, 10, hlo_op="add.5"), _event("memset", 900, 20),
            _event("k_unknown", 950, 5, hlo_op="fusion.99")])])
    split = summarize_phases(plane, names, phases)
    out = split["phases"]
    assert out["draft"] == {"busy_s": pytest.approx(150e-9), "kernel_time_s": pytest.approx(200e-9), "launches": 2,
                            "top_kernels": [{"name": "k_draft", "total_s": pytest.approx(200e-9), "count": 2}]}
    assert out["selection"]["launches"] == 1 and out["selection"]["busy_s"] == pytest.approx(300e-9)
    assert out["verification"]["launches"] == 1 and out["other"]["launches"] == 1
    assert out["unattributed"]["launches"] == 2 and "commit" not in out
    assert split["attributed_by"] == {"hlo_op": 5, "none": 2}
    assert split["unattributed_stats"] == []  # the memset carries no stats
    # fallbacks when the hlo_op stat is missing or unknown: a tf_op stat (a scope path), then the kernel's own name
    plane = NS(name="/device:GPU:0", lines=[NS(name="Stream #1(Compute)", events=[
        _event("k", 0, 10, hlo_op="fusion.99", tf_op="jit(f)/while/body/commit/scatter"),
        _event("fusion.1", 20, 10, correlation_id=3), _event("other_kernel", 40, 10, correlation_id=4)])])
    split = summarize_phases(plane, names, phases)
    assert split["phases"]["commit"]["launches"] == 1 and split["phases"]["draft"]["launches"] == 1
    assert split["attributed_by"] == {"tf_op": 1, "kernel_name": 1, "none": 1}
    assert split["unattributed_stats"] == ["correlation_id"]
    # inside a command buffer: a kernel named after its fusion with "_N" for ".N"; a nameless one between two
    # kernels of one phase takes that phase, between two phases it stays unattributed
    plane = NS(name="/device:GPU:0", lines=[NS(name="Stream #1(Compute)", events=[
        _event("fusion_1", 0, 10, hlo_op="command_buffer_7"), _event("nvjet_a", 20, 10, hlo_op="command_buffer_7"),
        _event("fusion_1", 40, 10, hlo_op="command_buffer_7"), _event("nvjet_b", 60, 10, hlo_op="command_buffer_7"),
        _event("gemm_2", 80, 10, hlo_op="command_buffer_7")])])
    split = summarize_phases(plane, names, phases)
    assert split["attributed_by"] == {"kernel_name": 3, "neighbours": 1, "none": 1}
    assert split["phases"]["draft"]["launches"] == 3 and split["phases"]["selection"]["launches"] == 1
    assert [k["name"] for k in split["unattributed_top"]] == ["nvjet_b"]
    # a trace whose kernels name none of the ops: all unattributed, in one pass (a long loop's 40k+ kernels)
    plane = NS(name="/device:GPU:0", lines=[NS(name="Stream #1(Compute)", events=[
        _event(f"k{i % 7}", 10 * i, 5, hlo_op=f"op.{i}") for i in range(50_000)])])
    split = summarize_phases(plane, names, phases)
    assert split["attributed_by"] == {"none": 50_000} and split["phases"]["unattributed"]["launches"] == 50_000


def test_phases_place_pallas_kernels_by_their_custom_call_name():
    """A Pallas (Triton) kernel inside a command buffer is named by its custom call's backend_config name (XLA adds
    "__N" to further instances): it maps to the scope its calls share, the innermost phase common to all of them."""
    text = "\n".join([
        '  %custom-call.7 = f32[2]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(f)/while/body/selection/target/pallas_call"}, '
        'backend_config={ir = "\\00\\01name = ", name = "jaxspec_srh_logits", num_warps = 8 : i32}',
        '  %custom-call.8 = f32[2]{0} custom-call(%q), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(f)/while/body/selection/draft_signal/pallas_call"}, '
        'backend_config={ir = "x", name = "jaxspec_srh_logits", num_warps = 8 : i32}',
        '  %custom-call.9 = f32[2]{0} custom-call(%r), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(f)/while/body/draft/layer0/pallas_call"}, backend_config={name = "attn"}',
        '  %custom-call.10 = f32[2]{0} custom-call(%r), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(f)/while/body/verification/layer0/pallas_call"}, backend_config={name = "attn"}'])
    names = op_names(text)
    assert names["jaxspec_srh_logits"] == "jit(f)/while/body/selection"  # the shared scope of its two calls
    assert names["attn"] == "jit(f)/while/body"  # two phases: their common scope, under no phase
    phases = ("draft", "verification", "selection", "commit")
    plane = NS(name="/device:GPU:0", lines=[NS(name="Stream #1(Compute)", events=[
        _event("jaxspec_srh_logits", 0, 10, hlo_op="command_buffer_4"),
        _event("jaxspec_srh_logits__1", 20, 10, hlo_op="command_buffer_4"),
        _event("attn__2", 40, 10, hlo_op="command_buffer_4")])])
    split = summarize_phases(plane, names, phases)
    assert split["phases"]["selection"]["launches"] == 2 and split["phases"]["other"]["launches"] == 1
    assert split["attributed_by"] == {"kernel_name": 3}


def test_phase_tables_count_unattributed_scoring_kernels_in_the_selection(monkeypatch):
    """Traces taken before the tracer placed Pallas kernels by name left the SRH scoring kernel unattributed; the
    tables move exactly those kernels (by name) to the selection and leave the rest."""
    from experiments.tables import dustin_speed as tables

    unattributed = {"busy_s": 10e-3, "kernel_time_s": 10e-3, "launches": 100, "top_kernels": [
        {"name": "nvjet_x", "total_s": 6e-3, "count": 18}, {"name": "jaxspec_srh_logits", "total_s": 3e-3, "count": 18},
        {"name": "jaxspec_srh_logits__1", "total_s": 0.5e-3, "count": 18}]}
    selection = {"busy_s": 5e-3, "kernel_time_s": 5e-3, "launches": 1000,
                 "top_kernels": [{"name": "input_reduce_fusion", "total_s": 1e-3, "count": 18}]}
    data = {"cases": {"ctx32768/b16": {"m": {"metrics": {"rounds": 18}, "timing": {"median_s": 0.18}}}}}
    plane = {"phases": {"unattributed": unattributed, "selection": selection, "draft": {
        "busy_s": 80e-3, "kernel_time_s": 80e-3, "launches": 9000, "top_kernels": []}}}
    monkeypatch.setattr(tables, "traced_rounds", lambda d: {"m": {"plane": plane}})
    phases = tables.traced_phases(data, "m")
    assert phases["selection"]["busy_s"] == pytest.approx(8.5e-3) and phases["selection"]["launches"] == 1036
    assert phases["unattributed"]["busy_s"] == pytest.approx(6.5e-3) and phases["unattributed"]["launches"] == 64
    assert [k["name"] for k in phases["unattributed"]["top_kernels"]] == ["nvjet_x"]
    assert phases["selection"]["moved_from_unattributed"]["launches"] == 36
    assert plane["phases"]["selection"]["busy_s"] == 5e-3  # the file's own numbers are left alone
    assert tables.phase_selection(data, "m")["selection_ms"] == pytest.approx(8.5 / 18)


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
    assert "windows" not in plane  # nothing annotated
    # a prefix that matches nothing gives no planes rather than a wrong one
    assert device_trace(lambda: f(x).block_until_ready(), prefixes=("/device:TPU",))["planes"] == {}

    def annotated():
        f(x).block_until_ready()
        with jax.profiler.TraceAnnotation("jaxspec.test.window"):
            for _ in range(3):
                f(x).block_until_ready()

    (plane,) = trace_on_backend(annotated)["planes"].values()
    window = plane["windows"]["jaxspec.test.window"]
    assert window["count"] == 1 and 0 < window["busy_s"] <= window["wall_s"]
    assert 0 < window["launches"] < plane["launches"]  # the call before the span is outside it


def test_dustin_speed_trace_flag(tmp_path, monkeypatch):
    from experiments.run import main
    from tests.conftest import DUSTIN_SPEED_ARGS as ARGS

    out = tmp_path / "speed.json"
    assert main(ARGS + ["--methods", "ar,dustin", "--trace", "--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["ctx320/b2"]
    for method in ("ar", "dustin"):
        trace = case[method]["trace"]
        assert trace["wall_s"] > 0 and trace["planes"]
        assert all(p["launches"] > 0 for p in trace["planes"].values())
    # the fused loop's device time split by round phase through its named scopes (a real CPU trace)
    (plane,) = case["dustin"]["trace"]["planes"].values()
    phases = plane["phases"]
    assert {"draft", "verification", "selection"} <= set(phases), phases
    assert all(phases[p]["launches"] > 0 and phases[p]["busy_s"] > 0 for p in ("draft", "verification", "selection"))
    assert sum(p["launches"] for p in phases.values()) == plane["launches"]
    assert "phases" not in next(iter(case["ar"]["trace"]["planes"].values()))  # AR is no round
    assert plane["phases_attributed_by"].get("hlo_op", 0) > 0

    # docs/results.md's phase table renders this file (under the 32k/b16 key the table reads)
    from experiments.tables import dustin_speed, inputs

    data = json.loads(out.read_text())
    data["cases"] = {"copy_bandwidth": data["cases"]["copy_bandwidth"], "ctx32768/b16": case}
    (tmp_path / "dustin_speed").mkdir()
    (tmp_path / "dustin_speed" / "phases.json").write_text(json.dumps(data))
    monkeypatch.setattr(inputs, "RESULTS", tmp_path)
    monkeypatch.setattr(inputs, "DUSTIN_TRACE_PHASES", (("cpu", "", "default heads", "dustin_speed/phases.json"),))
    table = dustin_speed.phase_split_table()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| method | draft | verification | selection |")
    (row,) = rows[1:]  # Dustin only: AR has no phases
    share = float(row.split("|")[-2].strip().rstrip(" %"))
    assert 0 < share < 100, row
    assert "hlo_op" in table and "not measured yet" not in table
    assert "x floor" in row.split("|")[2]  # the draft phase against its bytes floor (phase_bytes stored by the run)
    assert set(case["dustin"]["phase_bytes"]) == {"draft", "verification", "selection"}
    assert sum(case["dustin"]["phase_bytes"].values()) == case["dustin"]["round_bytes"]


def test_knapspec_trace_flag(tmp_path):
    from experiments.run import main

    out = tmp_path / "ks.json"
    argv = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "3", "--contexts", "64",
            "--max-new-tokens", "16", "--gamma-max", "2", "--gamma-buckets", "1", "--batches", "1",
            "--methods", "knapspec", "--candidate-plans", "0", "--plan-cost-repeats", "0", "--device-tag", "test",
            "--plan-at-start", "--reference-floor", "16", "--search-tokens", "3", "--finalists", "2",
            "--max-plan-fraction", "0", "--trace", "--out", str(out)]
    assert main(argv) == 0
    case = json.loads(out.read_text())["cases"]["test/summarize/ctx64/b1/knapspec"]
    assert set(case["trace"]) == {"ar", "knapspec"}
    for trace in case["trace"].values():
        assert trace["wall_s"] > 0 and all(p["launches"] > 0 for p in trace["planes"].values())
    # the plan and its stages are annotated: the traced KnapSpec run shows each as a window, AR none
    assert len(case["plans"]) == 1
    (plane,) = case["trace"]["knapspec"]["planes"].values()
    windows = plane["windows"]
    assert set(windows) == {"jaxspec.knapspec.plan"} | {f"jaxspec.knapspec.plan.{stage}"
                                                         for stage in ("boundary_states", "dp", "rescore")}
    whole = windows["jaxspec.knapspec.plan"]
    assert whole["count"] == 1 and whole["launches"] > 0
    assert sum(w["launches"] for name, w in windows.items() if name != "jaxspec.knapspec.plan") <= whole["launches"]
    assert "windows" not in next(iter(case["trace"]["ar"]["planes"].values()))


def test_trace_or_error_keeps_going(capsys):
    from experiments.trace import trace_or_error

    out = trace_or_error(lambda: 1 / 0, "[test] trace")
    assert set(out) == {"error"} and "ZeroDivisionError" in out["error"]
    assert "[test] trace failed" in capsys.readouterr().err
