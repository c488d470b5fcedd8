"""``dustin-speed`` end to end on a 2-layer model on the CPU (the H200 runs the paper shapes)."""

import json

import pytest

from experiments import dustin_speed
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
    # the three loops were compiled at once before the first was timed: each first run only runs
    case = data["cases"]["ctx320/b2"]
    assert (case["precompile"]["methods"], case["precompile"]["programs"]) == (["classic", "magicdec", "dustin"], 3)
    assert all(case[m]["compile_s"] < case["precompile"]["compile_s"] for m in ("classic", "magicdec", "dustin"))
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


# ---------------------------------------------------------------------------- --tau-from pair-speed JSONs
def _tau_args(tau_from, tau=None, gamma=4, budget=128):
    import argparse

    return argparse.Namespace(tau_from=tau_from, tau=tau, gamma=gamma, budget=budget)


def _from(path, case, context, distance, method, tau):
    """The per-point source record ``acceptance_plan`` must give."""
    return {"tau": tau, "file": path, "case": case, "context": context, "context_distance": distance,
            "method": method, "field": "metrics.tau_untruncated", "tau_truncated": pytest.approx(tau - 0.05)}


def test_tau_from_pair_speed_takes_each_methods_tau_at_the_batch_and_nearest_context(tmp_path):
    from experiments.dustin_speed import acceptance_plan
    from tests.conftest import write_pair_speed_json

    a = write_pair_speed_json(tmp_path / "a.json", {(8000, 16): {"sd": 2.1, "magicdec": 2.2, "dustin": 2.3},
                                                    (8000, 8): {"sd": 2.4, "magicdec": 2.5, "dustin": 2.6}})
    b = write_pair_speed_json(tmp_path / "b.json", {(16000, 16): {"sd": 3.1, "magicdec": 3.2, "dustin": 3.3},
                                                    (32000, 16): {"sd": 3.6, "magicdec": 3.7}})  # no dustin at 32k
    plan = acceptance_plan(_tau_args(f"{a},{b}"), [4000, 12000, 30000, 32768], [16, 8],
                           ["ar", "classic", "magicdec", "dustin"])
    points = plan["points"]
    assert set(points) == {f"ctx{c}/b{bt}" for c in (4000, 12000, 30000, 32768) for bt in (16, 8)}
    assert all(set(p) == {"classic", "magicdec", "dustin"} for p in points.values())  # AR needs none
    # below every measured context: the smallest
    assert points["ctx4000/b16"] == {"classic": _from(a, "ctx8000/b16", 8000, 4000, "sd", 2.1),
                                     "magicdec": _from(a, "ctx8000/b16", 8000, 4000, "magicdec", 2.2),
                                     "dustin": _from(a, "ctx8000/b16", 8000, 4000, "dustin", 2.3)}
    # 12000 is 4000 from both 8000 (file a) and 16000 (file b): the tie goes to the larger context
    assert points["ctx12000/b16"] == {"classic": _from(b, "ctx16000/b16", 16000, 4000, "sd", 3.1),
                                      "magicdec": _from(b, "ctx16000/b16", 16000, 4000, "magicdec", 3.2),
                                      "dustin": _from(b, "ctx16000/b16", 16000, 4000, "dustin", 3.3)}
    # 32000 did not measure dustin: dustin's tau is the nearest case that did (16000), the others 32000's
    assert points["ctx30000/b16"] == {"classic": _from(b, "ctx32000/b16", 32000, 2000, "sd", 3.6),
                                      "magicdec": _from(b, "ctx32000/b16", 32000, 2000, "magicdec", 3.7),
                                      "dustin": _from(b, "ctx16000/b16", 16000, 14000, "dustin", 3.3)}
    assert points["ctx32768/b16"]["dustin"] == _from(b, "ctx16000/b16", 16000, 16768, "dustin", 3.3)
    # batch 8: its only case, however near the batch-16 cases are
    for context in (4000, 12000, 30000, 32768):
        assert points[f"ctx{context}/b8"] == {
            "classic": _from(a, "ctx8000/b8", 8000, abs(context - 8000), "sd", 2.4),
            "magicdec": _from(a, "ctx8000/b8", 8000, abs(context - 8000), "magicdec", 2.5),
            "dustin": _from(a, "ctx8000/b8", 8000, abs(context - 8000), "dustin", 2.6)}
    record = plan["record"]
    assert plan["pair_speed"] and record["source"] == "pair-speed" and "fixed acceptance" in record["mode"]
    assert record["method_from"] == {"classic": "sd", "magicdec": "magicdec", "dustin": "dustin"}
    assert [(f["path"], f["gamma"], f["budget"], f["model"], f["draft"], f["dtype"], f["cases"])
            for f in record["files"]] == [(a, 4, 128, "target-m", "draft-m", "bfloat16", ["ctx8000/b16", "ctx8000/b8"]),
                                          (b, 4, 128, "target-m", "draft-m", "bfloat16",
                                           ["ctx16000/b16", "ctx32000/b16"])]
    assert record["points"]["ctx12000/b16"]["dustin"] == {"tau": 3.3, "file": b, "case": "ctx16000/b16",
                                                          "context_distance": 4000}
    assert "tau=" not in plan["title"] and "per point and method" in plan["title"]


def test_tau_from_pair_speed_needs_only_the_methods_that_run(tmp_path):
    from experiments.dustin_speed import acceptance_plan
    from tests.conftest import write_pair_speed_json

    path = write_pair_speed_json(tmp_path / "p.json", {(8000, 16): {"sd": 2.1}}, budget=512)
    # no magicdec / dustin: neither their taus nor the budget (256 here, 512 there) matter
    plan = acceptance_plan(_tau_args(path, budget=256), [9000], [16], ["ar", "classic"])
    assert plan["points"] == {"ctx9000/b16": {"classic": _from(path, "ctx8000/b16", 8000, 1000, "sd", 2.1)}}


def test_tau_from_pair_speed_file_methods_selector_combines_two_runs_of_one_point(tmp_path):
    """Two files measured dustin at one point: ``FILE:METHODS`` says which file supplies which method."""
    from experiments.dustin_speed import acceptance_plan
    from tests.conftest import write_pair_speed_json

    a = write_pair_speed_json(tmp_path / "a.json", {(8000, 16): {"sd": 2.1, "magicdec": 2.2, "dustin": 2.3}})
    b = write_pair_speed_json(tmp_path / "b.json", {(8000, 16): {"dustin": 2.9}})
    methods = ["ar", "classic", "magicdec", "dustin"]
    with pytest.raises(ValueError, match="dustin is also in"):
        acceptance_plan(_tau_args(f"{a},{b}"), [8000], [16], methods)
    plan = acceptance_plan(_tau_args(f"{a}:sd+magicdec,{b}"), [8000], [16], methods)
    assert plan["points"]["ctx8000/b16"] == {"classic": _from(a, "ctx8000/b16", 8000, 0, "sd", 2.1),
                                            "magicdec": _from(a, "ctx8000/b16", 8000, 0, "magicdec", 2.2),
                                            "dustin": _from(b, "ctx8000/b16", 8000, 0, "dustin", 2.9)}
    files = {f["path"]: f for f in plan["record"]["files"]}
    assert files[a]["methods_read"] == ["sd", "magicdec"] and "methods_read" not in files[b]
    with pytest.raises(ValueError, match="dustin is also in"):  # both files still asked for it
        acceptance_plan(_tau_args(f"{a}:dustin,{b}:dustin"), [8000], [16], ["ar", "dustin"])
    with pytest.raises(ValueError, match="unknown pair-speed method"):
        acceptance_plan(_tau_args(f"{a}:sd+dense"), [8000], [16], methods)


def test_tau_from_generate_json_or_tau_gives_one_tau_everywhere(tmp_path):
    from experiments.decode_speed import one_tau
    from experiments.dustin_speed import acceptance_plan

    gen = tmp_path / "gen.json"
    gen.write_text(json.dumps({"experiment": "generate", "results": {"metrics": {"tau": 2.7}, "model": "m",
                                                                      "draft": "d", "gamma": 4}}))
    methods = ["ar", "classic", "magicdec", "dustin"]
    plan = acceptance_plan(_tau_args(str(gen)), [320, 640], [2], methods)
    assert plan["points"] == {key: {m: {"tau": 2.7, "source": str(gen), "field": "results.metrics.tau"}
                                    for m in methods[1:]} for key in ("ctx320/b2", "ctx640/b2")}
    # the top-level record keeps its old shape (docs tables read acceptance.tau)
    assert plan["record"] == {"tau": 2.7, "source": str(gen), "measured_with": {"model": "m", "draft": "d", "gamma": 4},
                              "mode": plan["record"]["mode"]} and "fixed acceptance" in plan["record"]["mode"]
    assert "tau=2.70" in plan["title"] and not plan["pair_speed"]
    assert one_tau(_tau_args(str(gen)))["tau"] == 2.7  # bench-sd's reader
    plan = acceptance_plan(_tau_args(None, tau=3.5), [320], [2], methods)
    assert plan["points"] == {"ctx320/b2": {m: {"tau": 3.5, "source": "--tau"} for m in methods[1:]}}


def _refusals(tmp_path):
    from tests.conftest import write_pair_speed_json

    def pair(name, cases=None, **config):
        return write_pair_speed_json(tmp_path / name, cases or {(320, 2): {"sd": 2.0, "magicdec": 2.5, "dustin": 3.0}},
                                     **config)

    ok = pair("ok.json")
    gen = tmp_path / "gen.json"
    gen.write_text(json.dumps({"results": {"metrics": {"tau": 2.7}}}))
    b4 = pair("b4.json", {(320, 4): {"sd": 2.0, "magicdec": 2.5, "dustin": 3.0}})
    return [
        (b4, b4, "no case at batch 2 (measured batches: 4); run pair-speed --batches 2 or drop it"),
        (pair("nodustin.json", {(320, 2): {"sd": 2.0, "magicdec": 2.5}, (640, 2): {"sd": 2.0}}), None,
         "no case at batch 2 measured dustin (the tau of dustin)"),
        (pair("g3.json", gamma=3), None, "measured with gamma 3, not --gamma 4"),
        (pair("k256.json", budget=256), None, "measured with budget 256, not --budget 128 (the acceptance of "
                                              "magicdec, dustin depends on it)"),
        (f"{ok},{pair('other.json', {(640, 2): {'sd': 2.0}}, model='another')}", str(tmp_path / "other.json"),
         "but " + ok + " measured {'model': 'target-m'"),
        (f"{ok},{pair('dup.json')}", str(tmp_path / "dup.json"), "case ctx320/b2 dustin is also in " + ok),
        (f"{ok},{gen}", str(gen), "not a pair-speed JSON"),
        (pair("big.json", {(320, 2): {"sd": 5.5, "magicdec": 2.5, "dustin": 3.0}}), None,
         "ctx320/b2 sd metrics.tau_untruncated=5.5 lies outside [1, gamma + 1 = 5]"),
        (str(tmp_path / "absent.json"), None, "cannot read it"),
    ]


def test_tau_from_pair_speed_refused_before_anything_is_built_or_timed(tmp_path, capsys, monkeypatch):
    import experiments.decode_speed as decode_speed
    import experiments.dustin_speed as dustin_speed

    def never(*_, **__):
        raise AssertionError("a model was built or a timing taken before the --tau-from check")

    monkeypatch.setattr(dustin_speed, "init_params_on", never)
    monkeypatch.setattr(decode_speed, "copy_bandwidth", never)
    argv = [a for a in DUSTIN_SPEED_ARGS if a not in ("--tau", "2.5")]
    for i, (tau_from, named, message) in enumerate(_refusals(tmp_path)):
        out = tmp_path / f"out{i}.json"
        assert main(argv + ["--tau-from", str(tau_from), "--out", str(out)]) == 2, message
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: --tau-from "), err
        assert message in err, err
        assert str(named or tau_from) in err  # names the file
        assert not out.exists()  # no results file: nothing measured


def test_bench_sd_refuses_pair_speed_files(tmp_path, capsys, monkeypatch):
    import experiments.decode_speed as decode_speed
    from tests.conftest import write_pair_speed_json

    monkeypatch.setattr(decode_speed, "copy_bandwidth", lambda *_: (_ for _ in ()).throw(AssertionError("timed")))
    path = write_pair_speed_json(tmp_path / "p.json", {(320, 2): {"sd": 2.0}})
    gen = tmp_path / "gen.json"
    gen.write_text(json.dumps({"results": {"metrics": {"tau": 2.7}}}))
    for tau_from, message in ((path, f"--tau-from {path}: a pair-speed JSON (a tau per point and method); this "
                                     f"benchmark takes one tau"),
                              (f"{gen},{gen}", "several files must all be pair-speed JSONs")):
        assert main(["bench-sd", "--tau-from", tau_from, "--out", str(tmp_path / "sd.json")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "sd.json").exists()


@pytest.mark.slow
def test_dustin_speed_runs_each_method_at_its_pair_speed_tau(tmp_path, capsys):
    from jaxspec.decoding.speculative import acceptance_from_tau
    from tests.conftest import write_pair_speed_json

    measured = {"classic": ("sd", 1.4), "magicdec": ("magicdec", 3.0), "dustin": ("dustin", 4.6)}
    path = write_pair_speed_json(tmp_path / "pair.json", {
        (300, 2): {source: tau for source, tau in measured.values()},          # the nearest at batch 2
        (2000, 2): {"sd": 2.0, "magicdec": 2.0, "dustin": 2.0},                # farther
        (320, 4): {"sd": 5.0, "magicdec": 5.0, "dustin": 5.0}})                # same context, other batch
    out = tmp_path / "speed.json"
    argv = [a for a in DUSTIN_SPEED_ARGS if a not in ("--tau", "2.5")]
    assert main(argv + ["--tau-from", path, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    case = data["cases"]["ctx320/b2"]
    rows = {r["method"]: r for r in case["rows"]}
    for method, (source, tau) in measured.items():
        assert case[method]["fixed_tau"] == _from(path, "ctx300/b2", 300, 20, source, tau)
        # the engine of this method ran with this tau's distribution (mean tokens/round = tau)
        fixed = case[method]["metrics"]["fixed_acceptance"]
        assert fixed == pytest.approx(list(acceptance_from_tau(tau, 4)))
        assert sum((n + 1) * p for n, p in enumerate(fixed)) == pytest.approx(tau, abs=1e-6)
        assert rows[method]["fixed_tau"] == tau and rows[method]["tau_case"] == "ctx300/b2"
    realised = {m: case[m]["metrics"]["tau_untruncated"] for m in measured}
    assert realised["classic"] < 2.5 < realised["dustin"]  # 1.4 vs 4.6 drawn: the rounds differ
    assert "fixed_tau" not in rows["ar"]
    acc = data["acceptance"]
    assert acc["source"] == "pair-speed" and [f["path"] for f in acc["files"]] == [path]
    assert {m: r["tau"] for m, r in acc["points"]["ctx320/b2"].items()} == {m: t for m, (_, t) in measured.items()}
    title = next(line for line in printed.splitlines() if "FIXED acceptance" in line)
    assert "tau=" not in title and "tau per point and method" in title and path in title


@pytest.mark.slow
def test_dustin_speed_sparse_draft_variants(tmp_path):
    """Dustin-H with the draft reading sinks + a window or the last I_verify + a window: both time, select,
    and read fewer bytes per round than full-KV Dustin-H (the draft's attention over ~k, not the context)."""
    out = tmp_path / "speed.json"
    methods = "ar,dustin,dustin-kv-streaming,dustin-kv-verify-set"
    assert main(DUSTIN_SPEED_ARGS + ["--methods", methods, "--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["ctx320/b2"]
    assert [r["method"] for r in case["rows"]] == methods.split(",")
    for method in ("dustin-kv-streaming", "dustin-kv-verify-set"):
        assert case[method]["tok_s"] > 0 and case[method]["selection_timing"]["median_s"] > 0
        assert case[method]["round_bytes"] < case["dustin"]["round_bytes"], method


def test_tau_from_pair_speed_one_point_from_two_files_with_other_methods(tmp_path):
    """The sparse-draft variants measured in their own pair-speed run at a point the main file also has:
    each method takes its tau from the file that measured it."""
    from experiments.dustin_speed import acceptance_plan
    from tests.conftest import write_pair_speed_json

    main_file = write_pair_speed_json(tmp_path / "a.json", {(32000, 16): {"sd": 2.1, "magicdec": 2.2, "dustin": 2.3}})
    sparse = write_pair_speed_json(tmp_path / "s.json", {(32000, 16): {"dustin-kv-streaming": 2.8,
                                                                       "dustin-kv-verify-set": 2.9}})
    plan = acceptance_plan(_tau_args(f"{main_file},{sparse}"), [32768], [16],
                           ["ar", "dustin", "dustin-kv-streaming", "dustin-kv-verify-set"])
    point = plan["points"]["ctx32768/b16"]
    assert point["dustin"] == _from(main_file, "ctx32000/b16", 32000, 768, "dustin", 2.3)
    assert point["dustin-kv-streaming"] == _from(sparse, "ctx32000/b16", 32000, 768, "dustin-kv-streaming", 2.8)
    assert point["dustin-kv-verify-set"] == _from(sparse, "ctx32000/b16", 32000, 768, "dustin-kv-verify-set", 2.9)


def test_dustin_speed_with_a_reused_selection(tmp_path):
    """``--reselect-every 2``: the Dustin methods (with the verify-set draft KV too) run with the reuse state."""
    out = tmp_path / "reuse.json"
    args = DUSTIN_SPEED_ARGS + ["--methods", "ar,dustin,dustin-kv-verify-set", "--reselect-every", "2"]
    assert main(args + ["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dustin_config"]["reselect_every"] == 2
    rows = data["cases"]["ctx320/b2"]["rows"]
    assert [r["method"] for r in rows] == ["ar", "dustin", "dustin-kv-verify-set"] and all(r["tok_s"] > 0 for r in rows)
    for row in rows[1:]:  # a fresh selection, then a reuse round: the mean of the two per round
        timing = data["cases"]["ctx320/b2"][row["method"]]["selection_timing"]
        assert row["reselect_every"] == 2 and timing["reuse"]["median_s"] > 0
        assert row["selection_ms_per_round"] == pytest.approx(
            1e3 * (timing["median_s"] + timing["reuse"]["median_s"]) / 2)


def test_dustin_speed_on_fused_projections(tmp_path):
    """--fused-projections: AR and Dustin run on the fused layout (docs/methods.md §2, fused projections), recorded
    in the config."""
    out = tmp_path / "fused.json"
    assert main(DUSTIN_SPEED_ARGS + ["--methods", "ar,dustin", "--fused-projections", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["fused_projections"] is True
    rows = {r["method"]: r for r in data["cases"]["ctx320/b2"]["rows"]}
    assert rows["ar"]["tok_s"] > 0 and rows["dustin"]["tok_s"] > 0 and rows["dustin"]["tau"] > 1.0


def test_dustin_speed_scoring_kernel(tmp_path):
    """--scoring-layout pallas: the SRH scoring's logits from the Pallas kernel (interpreted on the CPU), recorded in
    the Dustin config; its bytes floor counts only the KV heads an SRH reads, as the groups layout's does."""
    out = tmp_path / "pallas.json"
    assert main(DUSTIN_SPEED_ARGS + ["--methods", "ar,dustin", "--scoring-layout", "pallas", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dustin_config"]["scoring_layout"] == "pallas"
    entry = data["cases"]["ctx320/b2"]["dustin"]
    rows = {r["method"]: r for r in data["cases"]["ctx320/b2"]["rows"]}
    assert entry["tok_s"] > 0 and rows["dustin"]["tau"] > 1.0
    # smollm2-135m-shape (3 KV heads of 64): the target's SRHs one per KV head, the draft's heads 0 and 1 both in KV 0
    assert entry["phase_bytes"]["selection"] == 2 * 2 * 320 * (3 * 64 + 64)
    with pytest.raises(SystemExit):
        main(DUSTIN_SPEED_ARGS + ["--scoring-layout", "rows", "--out", str(tmp_path / "x.json")])
    from jaxspec.dustin.config import SCORING_LAYOUTS

    assert SCORING_LAYOUTS == dustin_speed.SCORING_LAYOUTS  # the CLI's copy of the config's values


def test_dustin_speed_scoring_every_kv_head(tmp_path):
    """--scoring-layout heads: Dustin's SRH scoring as one product over every KV head (docs/methods.md §3.1), recorded
    in the Dustin config, with the selection's bytes floor counting every KV head of the scored layers."""
    out = tmp_path / "heads.json"
    assert main(DUSTIN_SPEED_ARGS + ["--methods", "ar,dustin", "--scoring-layout", "heads", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dustin_config"]["scoring_layout"] == "heads"
    entry = data["cases"]["ctx320/b2"]["dustin"]
    assert entry["tok_s"] > 0 and sum(entry["phase_bytes"].values()) == entry["round_bytes"]
    # smollm2-135m-shape: 3 KV heads of 64; 2 bytes x batch 2 x 320 positions, the target and the draft layer
    assert entry["phase_bytes"]["selection"] == 2 * 2 * 320 * (3 * 64 + 3 * 64)
