"""``attention-device-time`` on a tiny layer shape (CPU, interpret mode): every variant checked against the
jnp reference, per-layer device and host times from the profiler, the speed-up's bookkeeping, bad input."""

import json

import pytest

from experiments import kernels
from experiments.run import main


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(kernels.SHAPES, "tiny", (4, 2, 32))  # q heads, kv heads, head_dim
    monkeypatch.setitem(kernels.LAYERS, "tiny", 3)


def test_attention_device_time_records_every_variant(tiny_shape, tmp_path):
    out = tmp_path / "device.json"
    assert main(["attention-device-time", "--shapes", "tiny", "--contexts", "256", "--batches", "2", "--budgets",
                 "64", "--sparse-configs", "32x2x4,16x1x4", "--repeats", "2", "--copy-gib", "0.01",
                 "--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["tiny/ctx256/b2/k64"]
    rows = {r["variant"]: r for r in case["rows"]}
    assert set(rows) == {"ours_dense", "xla_dense", "ours_sparse_c32_p2_w4", "ours_sparse_c16_p1_w4"}
    for row in rows.values():
        assert row["layers"] == 3 and len(row["device_s_runs"]) == 2 and len(row["wall_s_runs"]) == 2
        assert row["device_us_per_layer"] > 0 and row["launches_per_layer"] > 0
        assert row["rel_err"] < 2e-2, row  # bf16 against the jnp reference
        # the kernel-by-kernel split is of one of the traced runs and adds up to its device time
        total = row["own_kernels_us_per_layer"] + row["other_kernels_us_per_layer"]
        assert any(total == pytest.approx(t / 3 * 1e6) for t in row["device_s_runs"]), row
        assert row["kernels"] and all(k["us_per_layer"] > 0 and k["launches_per_layer"] > 0 for k in row["kernels"])
    dense = min(("ours_dense", "xla_dense"), key=lambda n: rows[n]["device_us_per_layer"])
    sparse = min((n for n in rows if "sparse" in n), key=lambda n: rows[n]["device_us_per_layer"])
    assert (case["fastest_dense"], case["fastest_sparse"]) == (dense, sparse)
    assert case["speedup_device"] == pytest.approx(rows[dense]["device_us_per_layer"]
                                                   / rows[sparse]["device_us_per_layer"])
    assert case["byte_ratio"] == pytest.approx(256 / 64)


def test_kernel_breakdown_separates_own_kernels_from_the_rest():
    planes = [{"kernel_time_s": 9e-6, "top_kernels": [
        {"name": "jaxspec_sparse_history_attention", "total_s": 6e-6, "count": 3},
        {"name": "loop_dynamic_slice_fusion", "total_s": 2e-6, "count": 6},
        {"name": "jaxspec_merge", "total_s": 1e-6, "count": 3}]}]
    split = kernels.kernel_breakdown(planes, layers=3)
    assert split["own_kernels_us_per_layer"] == pytest.approx(7 / 3)
    assert split["other_kernels_us_per_layer"] == pytest.approx(2 / 3)
    assert [k["name"] for k in split["kernels"]] == ["jaxspec_sparse_history_attention", "loop_dynamic_slice_fusion",
                                                     "jaxspec_merge"]
    assert split["kernels"][1]["launches_per_layer"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--shapes", "nope"], "unknown shape(s) ['nope']"),
    (["--budgets", "48"], "--budgets 48: no --sparse-configs tiling divides it"),
    (["--repeats", "0"], "--repeats 0 / --layers 0: repeats >= 1"),
])
def test_attention_device_time_bad_input(tiny_shape, tmp_path, capsys, extra, message):
    argv = ["attention-device-time", "--shapes", "tiny", "--contexts", "256", "--batches", "2", "--budgets", "64",
            "--sparse-configs", "32x2x4", "--out", str(tmp_path / "x.json"), *extra]  # the last of a flag counts
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_tables_state_the_device_time_targets(tiny_shape, tmp_path, monkeypatch, request):
    """docs/results.md's note reads the device-time file when it exists: met / missed against 20x (7B) and
    28x (72B) from the file's own speed-ups (here a tiny CPU run stored under the 7B name)."""
    from experiments import tables

    monkeypatch.setattr(tables.inputs, "RESULTS", tmp_path)
    tables.inputs.load.cache_clear()
    request.addfinalizer(tables.inputs.load.cache_clear)  # nothing read from tmp_path outlives the test
    assert "not measured yet" in tables.device_time_note()
    out = tmp_path / tables.KERNEL_DEVICE
    out.parent.mkdir(parents=True)
    assert main(["attention-device-time", "--shapes", "tiny", "--contexts", "256", "--batches", "2", "--budgets",
                 "64", "--sparse-configs", "32x2x4", "--repeats", "1", "--copy-gib", "0.01", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    data["cases"]["qwen2.5-7b/ctx32768/b16/k512"] = case = data["cases"].pop("tiny/ctx256/b2/k64")
    out.write_text(json.dumps(data))
    tables.inputs.load.cache_clear()
    note = tables.device_time_note()
    verdict = "**met**" if case["speedup_device"] >= 20 else "**missed**"
    assert f"qwen2.5-7b {case['speedup_device']:.1f}x (target 20x: {verdict}" in note
    assert "qwen2.5-72b: not measured" in note


def test_a_variant_that_fails_on_the_device_is_reported_not_fatal(tiny_shape, tmp_path, monkeypatch):
    """A cuDNN failure (here forced) becomes an error row; the speed-ups use the variants that ran."""
    import jax

    from experiments import trace
    from pallas_kernels import attention

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # takes the cuDNN branch; kernels stay interpreted
    monkeypatch.setattr(trace, "trace_on_backend", lambda fn, label="", top=25: trace.device_trace(
        fn, prefixes=("/host:CPU",), kernel_lines=lambda name: name not in trace.META_LINES and name != "python"))

    real_dense, real_sparse = attention.dense_history_partials, attention.sparse_history_partials
    monkeypatch.setattr(attention, "dense_history_partials",
                        lambda *a, **k: real_dense(*a, **{**k, "interpret": True}))
    monkeypatch.setattr(attention, "sparse_history_partials",
                        lambda *a, **k: real_sparse(*a, **{**k, "interpret": True}))

    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN refuses this shape")

    monkeypatch.setattr(jax.nn, "dot_product_attention", refuse)
    out = tmp_path / "device.json"
    assert main(["attention-device-time", "--shapes", "tiny", "--contexts", "256", "--batches", "2", "--budgets",
                 "64", "--sparse-configs", "32x2x4", "--repeats", "1", "--copy-gib", "0.01", "--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["tiny/ctx256/b2/k64"]
    rows = {r["variant"]: r for r in case["rows"]}
    assert rows["cudnn_dense"]["kind"] == "error" and "cuDNN refuses" in rows["cudnn_dense"]["error"]
    assert case["fastest_dense"] in ("ours_dense", "xla_dense") and case["speedup_device"] > 0


def test_unrolled_layers_run_one_call_per_layer_without_loop_work(tiny_shape, tmp_path):
    """--layer-loop unrolled: the same variants and checks, each layer a call of its own on inputs of its own;
    the scan's per-layer slices and stacked writes are gone, so fewer kernels run beside the attention."""
    runs = {}
    for loop in ("scan", "unrolled"):
        out = tmp_path / f"{loop}.json"
        assert main(["attention-device-time", "--shapes", "tiny", "--contexts", "256", "--batches", "2", "--budgets",
                     "64", "--sparse-configs", "32x2x4", "--repeats", "1", "--copy-gib", "0.01", "--layer-loop", loop,
                     "--out", str(out)]) == 0
        runs[loop] = json.loads(out.read_text())["cases"]["tiny/ctx256/b2/k64"]
    assert runs["unrolled"]["layer_loop"] == "unrolled" and runs["scan"]["layer_loop"] == "scan"
    for loop, case in runs.items():
        rows = {r["variant"]: r for r in case["rows"]}
        assert set(rows) == {"ours_dense", "xla_dense", "ours_sparse_c32_p2_w4"}
        for row in rows.values():
            assert row["layers"] == 3 and row["rel_err"] < 2e-2, (loop, row)
    # XLA's own attention shows the loop plainly (the Pallas variants run interpreted here, loops of their own):
    # the scan runs as a while loop with its slices and stacked writes, the unrolled layers as plain calls
    xla = {loop: next(r for r in case["rows"] if r["variant"] == "xla_dense") for loop, case in runs.items()}
    assert any(k["name"].startswith("while") for k in xla["scan"]["kernels"])
    assert not any(k["name"].startswith("while") for k in xla["unrolled"]["kernels"])
    assert xla["unrolled"]["launches_per_layer"] < xla["scan"]["launches_per_layer"]
