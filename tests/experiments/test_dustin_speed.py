"""``dustin-speed`` end to end on a 2-layer model on the CPU (the H200 runs the paper shapes)."""

import json

import pytest

from experiments.run import main
from tests.conftest import DUSTIN_SPEED_ARGS


@pytest.mark.slow
def test_dustin_speed_runs_all_methods_and_resumes(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(DUSTIN_SPEED_ARGS + ["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["cases"]["ctx320/b2"]["rows"]
    assert [r["method"] for r in rows] == ["ar", "classic", "magicdec", "dustin"]
    for row in rows:
        assert row["tok_s"] > 0 and row["roofline_tok_s"] > 0
    assert rows[0]["speedup"] == 1.0
    # fixed acceptance: every speculative method commits the same mean tokens per round
    taus = {r["method"]: r["tau"] for r in rows[1:]}
    assert max(taus.values()) - min(taus.values()) < 1.0 and min(taus.values()) > 1.0
    assert data["cases"]["ctx320/b2"]["dustin"]["selection_timing"]["median_s"] > 0
    assert "fixed acceptance" in data["acceptance"]["mode"]
    # a rerun resumes instead of measuring again
    assert main(DUSTIN_SPEED_ARGS + ["--out", str(out)]) == 0
    assert json.loads(out.read_text())["cases"]["ctx320/b2"]["rows"] == rows


@pytest.mark.slow
def test_dustin_speed_profile_splits_a_round(tmp_path):
    out = tmp_path / "speed.json"
    assert main(DUSTIN_SPEED_ARGS + ["--methods", "ar,classic,dustin", "--profile", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["cases"]["ctx320/b2"]["rows"]}
    for method in ("classic", "dustin"):
        row = rows[method]
        assert row["draft_ms"] > 0 and row["verify_ms"] > 0 and row["other_ms"] > 0
        assert data["cases"]["ctx320/b2"][method]["profile"]["profile_rounds"] >= 1
    assert "draft_ms" not in rows["ar"]
    # Dustin's verify phase runs the selection first; the split keeps both parts
    dustin = rows["dustin"]
    assert dustin["verification_ms"] == pytest.approx(max(dustin["verify_ms"] - dustin["selection_ms"], 0.0))


def test_dustin_speed_bad_input(tmp_path, capsys):
    cases = [(DUSTIN_SPEED_ARGS[:-2] + ["--methods", "dustin"], "ar is required"),
             ([a if a != "320" else "128" for a in DUSTIN_SPEED_ARGS], "smaller than the context"),
             ([a if a != "128" else "100" for a in DUSTIN_SPEED_ARGS], "budget")]
    for i, (argv, message) in enumerate(cases):
        assert main(argv + ["--out", str(tmp_path / f"{i}.json")]) != 0
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_dustin_speed_on_a_mesh(tmp_path):
    """The multi-device code path on 8 CPU host devices: tensor-parallel target created sharded, draft
    replicated over tensor, sharded random caches, Pallas kernels per device (interpret mode),
    all-reduce cost per step measured."""
    import os
    import subprocess
    import sys

    out = tmp_path / "mesh.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    argv = ["--mesh", "data=2,tensor=4", "--target-shape", "qwen2.5-7b-shape", "--draft-shape", "qwen2.5-0.5b-shape",
            "--override", "vocab_size=512,hidden_size=256,intermediate_size=512,num_heads=8,num_kv_heads=4,head_dim=32",
            "--layers", "2", "--contexts", "256", "--batches", "2", "--budget", "128", "--tau", "2.5",
            "--new-tokens", "4", "--repeats", "1", "--methods", "ar,dustin", "--attention-backend", "pallas-interpret",
            "--copy-gib", "0.01", "--draft-heads", "0,1", "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "experiments.run", "dustin-speed", *argv], env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mesh"]["shape"] == {"data": 2, "tensor": 4}
    case = data["cases"]["ctx256/b2"]
    assert [r["method"] for r in case["rows"]] == ["ar", "dustin"]
    assert case["allreduce"]["ar_step"]["tensor"] == 4 and case["allreduce"]["ar_step"]["seconds"] > 0
    assert case["attention"]["dense_layer_s"] > 0 and case["attention"]["sparse_layer_s"] > 0
