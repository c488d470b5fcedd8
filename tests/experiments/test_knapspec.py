"""The knapspec experiment end to end on a tiny random model, and the pieces it relies on."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import knapspec as knapspec_experiment
from experiments.run import main
from jaxspec.config import preset
from jaxspec.decoding.autoregressive import generate, pad_prompts, prefill
from jaxspec.decoding.speculative import EngineConfig
from jaxspec.knapspec import dp
from jaxspec.knapspec.latency import LatencyModel
from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_generate
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import init_params


def test_pearson():
    assert knapspec_experiment.pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert knapspec_experiment.pearson([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    assert knapspec_experiment.pearson([1, 2, 3], [5, 5, 5]) is None  # no spread: undefined, not 0
    assert knapspec_experiment.pearson([1, 2], [1, 2]) is None  # two points always correlate perfectly


def test_stretch_fit_separates_a_stretch_fixed_cost_from_its_steps():
    fit = knapspec_experiment.stretch_fit([(steps, 0.010 + 0.003 * steps) for steps in (8, 64, 183)], 0.0025)
    assert fit["fixed_s"] == pytest.approx(0.010) and fit["step_s"] == pytest.approx(0.003)
    assert fit["step_over_ar_step"] == pytest.approx(1.2)
    assert knapspec_experiment.stretch_fit([(64, 0.2), (64, 0.21)]) is None  # one length: no intercept
    assert knapspec_experiment.stretch_fit([]) is None


def test_auto_branch_chunk_bounds_the_dp_scores():
    config = preset("qwen2.5-7b-shape")
    assert knapspec_experiment.auto_branch_chunk(config, 1, 2048, 16, 43) is None
    chunk = knapspec_experiment.auto_branch_chunk(config, 16, 32768 + 300, 64, 85)
    per_branch = 3 * 4 * 16 * config.num_heads * 64 * (32768 + 300)
    assert chunk >= 1 and (chunk == 1 or chunk * per_branch <= 4e9)


def test_stacked_layers_are_reused_only_for_the_same_layer_list():
    config = preset("smollm2-135m-shape", num_layers=3, vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_heads=2, num_kv_heads=1, head_dim=16, dtype="float32")
    params = init_params(config, jax.random.PRNGKey(0))
    first = dp.stacked_scan_layers(params)
    assert dp.stacked_scan_layers(params) is first
    other = params.replace(layers=tuple(jax.tree.map(lambda x: x * 2, layer) for layer in params.layers))
    second = dp.stacked_scan_layers(other)
    assert second is not first
    np.testing.assert_allclose(np.asarray(second.wq), 2 * np.asarray(first.wq))
    assert dp.stacked_scan_layers(params, reuse=False) is not first


def test_prefilled_cache_gives_the_same_tokens_and_is_not_consumed():
    config = preset("smollm2-135m-shape", num_layers=4, vocab_size=97, hidden_size=32, intermediate_size=64,
                    num_heads=2, num_kv_heads=1, head_dim=16, dtype="float32")
    params = init_params(config, jax.random.PRNGKey(1), scale=0.3)
    prompts = [list(np.random.default_rng(0).integers(0, 97, 40))]
    ks = KnapSpecConfig(gamma_max=3, plan_interval=8, gamma_buckets=(1, 2))
    engine = EngineConfig(gamma=3, max_new_tokens=48)
    capacity = 40 + 48 + 3 + 2
    latency = LatencyModel(c1=1.0, c2=1e-3, c3=0.5, c0=0.5)
    tokens, lengths = pad_prompts(prompts)
    prefilled = prefill(params, config, tokens, lengths, init_cache(config, 1, capacity))
    keep = jax.tree.map(np.asarray, prefilled)
    fresh = knapspec_generate(params, config, prompts, latency=latency, knapspec=ks, engine=engine, capacity=capacity)
    shared = knapspec_generate(params, config, prompts, latency=latency, knapspec=ks, engine=engine,
                               capacity=capacity, prefilled=prefilled)
    ar = generate(params, config, prompts, 48)
    assert shared.rows() == fresh.rows() == ar.rows()
    assert len(shared.metrics["knapspec_plans"]) >= 1  # the planner ran (rounds 6, 14, ...)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), prefilled, keep)  # still valid
    with pytest.raises(ValueError, match="capacity"):
        knapspec_generate(params, config, prompts, latency=latency, knapspec=ks, engine=engine,
                          capacity=capacity + 1, prefilled=prefilled)


def test_the_dp_memory_bound_uses_the_rows_and_tokens_the_dp_runs_on():
    """The real 1.5B at 32k, batch 16: bounded as if the DP ran on all 16 rows and 64 tokens, its 85 slot
    states went through each attention one at a time; on its 2 plan rows x 3 search tokens they fit at
    once. Without a two-stage plan the window (64, or --max-reference-tokens) sets the tokens."""
    from types import SimpleNamespace

    from experiments.knapspec import auto_branch_chunk, dp_shape

    cfg = SimpleNamespace(num_heads=12)
    assert auto_branch_chunk(cfg, 16, 32268, 64, 85) == 1
    two_stage = SimpleNamespace(plan_rows=2, search_tokens=3, max_reference_tokens=None)
    assert dp_shape(two_stage, 16) == (2, 3) and auto_branch_chunk(cfg, 2, 32268, 3, 85) is None
    paper = SimpleNamespace(plan_rows=None, search_tokens=None, max_reference_tokens=None)
    assert dp_shape(paper, 16) == (16, 64) and dp_shape(paper, 1) == (1, 64)
    assert dp_shape(SimpleNamespace(plan_rows=32, search_tokens=None, max_reference_tokens=24), 8) == (8, 24)


def test_dp_attention_check_compares_the_kernel_dp_with_the_reference(tmp_path, capsys):
    """--dp-attention-check: the DP of the run's planning shape (2 of 3 rows, 3 search tokens) with the
    reference attention and with the interpreted kernel agrees, and both are timed; bad combinations are
    refused before any model loads."""
    out = tmp_path / "dp.json"
    argv = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "4", "--contexts", "64",
            "--max-new-tokens", "8", "--batches", "3", "--methods", "knapspec", "--plan-rows", "2",
            "--search-tokens", "3", "--reference-floor", "8", "--plan-at-start", "--max-plan-fraction", "0",
            "--dp-attention", "pallas-interpret", "--dp-attention-check", "1", "--plan-cost-repeats", "0",
            "--candidate-plans", "0", "--device-tag", "test", "--latency-fit", "isolated", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    check = data["cases"]["test/summarize/ctx64/b3/dp_attention"]
    assert check["dp_attention"] == "pallas-interpret" and check["rows"] == 2 and check["search_tokens"] == 3
    assert check["same_valid"] and check["same_masks"] and check["max_value_diff"] < 1e-3
    assert check["max_alpha_diff"] == 0.0
    assert len(check["reference_s"]) == len(check["folded_s"]) == 1 and check["median_folded_s"] > 0
    for block in ("128", "256"):  # larger kernel row blocks, each checked against the reference too
        timed = check["kernel_rows_per_call"][block]
        assert timed["same_masks"] and timed["median_s"] > 0
    assert data["config"]["dp_attention"] == "pallas-interpret" and data["config"]["dp_attention_check"] == 1
    plans = data["cases"]["test/summarize/ctx64/b3/knapspec"]["plans"]
    assert plans and all(p["dp_attention"] == "pallas-interpret" for p in plans)
    capsys.readouterr()
    for extra, message in ((["--dp-attention", "xla"], "--dp-attention-check compares"),
                           (["--dp-attention", "pallas"], "needs a GPU"),
                           (["--dp-attention-check", "-1"], "must be >= 0")):
        assert main(argv[:-2] + extra + ["--out", str(tmp_path / "bad.json")]) != 0
        err = capsys.readouterr().err
        assert message in err and "profiling" not in err  # refused before any work
    assert not (tmp_path / "bad.json").exists()


def test_experiment_end_to_end_on_a_tiny_random_model(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ks.json"
    argv = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "4", "--contexts", "64",
            "--max-new-tokens", "40", "--gamma-max", "2", "--gamma-buckets", "1", "--batches", "1",
            "--methods", "knapspec,static-skip,knapspec-official,knapspec-budget,knapspec-target-ref",
            "--candidate-plans", "3",
            "--candidate-reference-tokens", "8", "--attention-budget", "16", "--attention-sinks", "2",
            "--plan-cost-repeats", "1", "--device-tag", "test", "--latency-fit", "isolated", "--out", str(out),
            "--max-plan-fraction", "0",  # 40 tokens could not pay for a DP under a planning budget: plan anyway
            "--static-plans",  # the re-planning methods draft each plan with a forward compiled for it
            "--plot", str(tmp_path / "f.png")]
    from experiments.knapspec import experiment  # the module whose driver calls release_memory

    released = []
    real_release = experiment.release_memory
    monkeypatch.setattr(experiment, "release_memory",
                        lambda clear_compiled=False: (released.append(clear_compiled), real_release(clear_compiled)))
    assert main(argv) == 0
    assert released == [True]  # the case's programs dropped after it (one per case)
    data = json.loads(out.read_text())
    cases = data["cases"]
    assert data["environment"]["load_average"] is not None
    for method in ("knapspec", "static-skip", "knapspec-official", "knapspec-budget", "knapspec-target-ref"):
        case = cases[f"test/summarize/ctx64/b1/{method}"]
        assert case["identical_to_ar"] is True  # greedy: every method reproduces AR
        check = case["draft_step_check"]  # one draft step, dynamic and static, against the latency model
        if method == "knapspec-budget":  # the budget plan's own forward (its codes compiled in), not a skip mask
            assert check["plan"] == "budget" and "dynamic_s" not in check
            assert check["n_dense_attn"] + check["n_budget_attn"] + check["n_skip_attn"] == 4
            assert case["time_split_estimate"]["draft_forward_budget_s"] > 0
        else:
            assert check["dynamic_s"] > 0
        assert check["static_s"] > 0 and check["predicted_s"] > 0
        # timed as the profile and the draft loop run forwards; the one-call-per-forward times kept beside
        assert check["timed"] == "4 forwards per jitted call" and check["single_call_static_s"] > 0
        assert case["tokens_per_s"] > 0 and case["ar_tokens_per_s"] > 0
        split = case["time_split_estimate"]
        assert split["draft_forward_s"] > 0 and split["verify_forward_s"] > 0
        # the engine's own chunk times: plain stretches + rounds + planning + the controller's rest = decode
        measured = case["time_split_measured"]
        assert measured["plain_steps"] == case["ar_steps"]
        assert (measured["plain_stretches_s"] > 0) == (case["ar_steps"] > 0)
        assert (measured["rounds_s"] > 0) == (case["rounds"] > 0)
        assert measured["plain_stretches_s"] + measured["rounds_s"] + measured["plan_s"] + measured[
            "controller_s"] == pytest.approx(case["timings"]["decode_s"])
        assert measured["controller_s"] > -1e-3  # the chunks lie inside the decode's wall time
        if case["ar_steps"]:
            assert measured["plain_step_s"] == pytest.approx(measured["plain_stretches_s"] / case["ar_steps"])
    knapspec = cases["test/summarize/ctx64/b1/knapspec"]
    assert knapspec["plans"] and knapspec["plans"][0]["t_token"] > 0  # planned with the per-token constant
    assert knapspec["plan_allowance"] == {"tokens": None, "skip": False}  # no budget, no cap
    assert knapspec["static_plans"] is True and knapspec["compiled_plans"] >= 1
    assert cases["test/summarize/ctx64/b1/static-skip"]["static_plans"] is False  # a fixed plan: static_plan
    assert cases["test/summarize/ctx64/b1/knapspec-official"]["honor_gamma"] is False
    budget_plan = cases["test/summarize/ctx64/b1/knapspec-budget"]["budget_plan"]
    assert budget_plan["sinks"] == 2 and budget_plan["window"] == 14 and budget_plan["reference_tokens"] == 8
    candidates = cases["test/summarize/ctx64/b1/candidates"]
    assert candidates["reference_tokens_per_row"] == 8 and 0 < candidates["plan_share_of_ar_decode"]
    for row in candidates["candidates"]:  # both DP references' estimate of each candidate; the run's own is branch
        assert row["alpha_branch"] == pytest.approx(row["alpha"], abs=1e-6) and 0 <= row["alpha_target"] <= 1
        # priced as the planner prices it: early exit modelled from the DP's confidence statistics
        assert row["exit_aware_tpt"] is True and 0 <= row["p_ac"] <= row["p_c"] <= 1
        assert row["predicted_tpt"] > 0 and row["predicted_tpt_no_exit"] > 0
    plan = candidates["plan"]
    same = [r for r in candidates["candidates"] if r["index"] == plan["index"] and r["gamma"] == plan["gamma"]]
    for row in same:  # the chosen plan's TPT is its candidate row's
        assert row["predicted_tpt"] == pytest.approx(plan["predicted_tpt"], rel=1e-9)
    fixed = [k for k in cases if k.startswith("test/summarize/ctx64/b1/fixed/")]
    assert 1 <= len(fixed) <= 4  # spread over the weights, plus the planner's choice
    chosen = candidates["plan"]["index"]
    assert chosen is None or any(cases[k]["candidate"] == chosen for k in fixed) or \
        not any(c["index"] == chosen and c["weight"] > 0 for c in candidates["candidates"])
    correlation = cases["test/summarize/ctx64/b1/correlation"]
    assert correlation["plans"] == len(fixed)
    assert correlation["exit_aware_tpt"] is True and "pearson_predicted_tpt_no_exit_vs_speedup" in correlation
    assert "pearson_measured_acceptance_vs_speedup" in correlation
    for mode in ("branch", "target"):
        errors = [abs(cases[k][f"alpha_{mode}"] - cases[k]["acceptance_rate"]) for k in fixed]
        assert correlation[f"alpha_{mode}_mean_abs_error"] == pytest.approx(sum(errors) / len(errors))
    cost = cases["test/summarize/ctx64/b1/plan_cost"]
    assert len(cost["restack_each_plan_s"]) == len(cost["reuse_stacked_s"]) == 1
    assert data["latency_b1"]["fit"]["c0"] > 0
    assert (tmp_path / "f.png").stat().st_size > 0

    # a rerun with the same --out resumes: nothing is measured again
    def refuse(*args, **kwargs):
        raise AssertionError("re-measured a case that is already in the results file")

    monkeypatch.setattr(knapspec_experiment.Case, "run_method", refuse)
    monkeypatch.setattr(knapspec_experiment.Case, "plan_cost", refuse)
    monkeypatch.setattr(knapspec_experiment.Case, "candidates", refuse)
    assert main(argv[:-2]) == 0
    # cases planned with another latency model than the profile now gives (here: the saved one altered): the
    # rest of the file is planned with the saved model, which the file keeps
    saved = json.loads(out.read_text())
    saved["latency_b1"]["fit"]["u"] = 1.0
    out.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(argv[:-2]) == 0
    err = capsys.readouterr().err
    assert "[resume] batch 1: planning with the latency model" in err and "(differs in: u)" in err
    assert json.loads(out.read_text())["latency_b1"]["fit"]["u"] == 1.0
    # a file that kept only the fit cannot be planned with as it was: refused before any case runs
    saved = json.loads(out.read_text())
    del saved["latency_b1"]["forward"]
    out.write_text(json.dumps(saved))
    assert main(argv[:-2]) == 2
    err = capsys.readouterr().err
    assert "planned with another latency model" in err and "does not keep enough of it" in err


@pytest.mark.parametrize("kwargs, message", [
    (dict(plan_at_start=True), "--plan-at-start plans on the prompt's last tokens before any round: give "
                               "--reference-floor R"),
    (dict(reference_floor=0), "--reference-floor=0: must be >= 1"),
    (dict(plan_rows=0), "--plan-rows=0: must be >= 1"),
    (dict(search_tokens=0), "--search-tokens=0: must be >= 1"),
    (dict(finalists=0), "--finalists=0: must be >= 1"),
])
def test_planning_flags_are_checked_before_anything_loads(kwargs, message):
    from experiments.knapspec import check_two_stage

    args = dict(search_tokens=None, finalists=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_two_stage(args.pop("search_tokens"), args.pop("finalists"), **args)
    check_two_stage(None, 4, reference_floor=64, plan_at_start=True)  # the pair it needs is accepted


def test_plan_cost_scale_from_takes_the_largest_measured_over_predicted(tmp_path):
    from experiments.knapspec import plan_cost_scale_from

    def results(name, plans, model="qwen2.5-coder-1.5b", device="h200", experiment="knapspec", **config):
        path = tmp_path / name
        path.write_text(json.dumps({"experiment": experiment, "config": dict(model=model, device_tag=device, **config),
                                    "cases": {"a": {"plans": plans}, "b": {"plans": []}, "c": "not a case"}}))
        return str(path)

    a = results("a.json", [{"seconds": 0.4, "predicted_seconds": 0.1}, {"seconds": 0.2, "predicted_seconds": None}])
    b = results("b.json", [{"seconds": 0.3, "predicted_seconds": 0.15}], plan_cost_scale=3.0)  # already scaled 3x
    assert plan_cost_scale_from([a], "qwen2.5-coder-1.5b", "h200") == pytest.approx(4.0)
    assert plan_cost_scale_from([a, b], "qwen2.5-coder-1.5b", None) == pytest.approx(6.0)
    # plans of the reference DP attention (no field: "xla") price a run of the same, not one of the kernel's
    assert plan_cost_scale_from([a], "qwen2.5-coder-1.5b", "h200", "xla") == pytest.approx(4.0)
    with pytest.raises(ValueError, match=re.escape("its plans ran the DP with 'xla' attention, this run's is "
                                                   "'pallas'")):
        plan_cost_scale_from([a], "qwen2.5-coder-1.5b", "h200", "pallas")
    folded = results("f.json", [{"seconds": 0.2, "predicted_seconds": 0.1, "dp_attention": "pallas"}])
    assert plan_cost_scale_from([folded], "qwen2.5-coder-1.5b", "h200", "pallas") == pytest.approx(2.0)
    for paths, model, device, message in [
            ([results("m.json", [])], "qwen2.5-coder-1.5b", "h200", "no plan with a predicted time"),
            ([a], "smollm2-135m", "h200", "its plans are of model 'qwen2.5-coder-1.5b', this run's is 'smollm2-135m'"),
            ([a], "qwen2.5-coder-1.5b", "cpu", "measured on 'h200', this run is tagged 'cpu'"),
            ([results("x.json", [], experiment="pair-speed")], "qwen2.5-coder-1.5b", None, "not a knapspec results"),
            ([str(tmp_path / "none.json")], "qwen2.5-coder-1.5b", None, "no such file")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            plan_cost_scale_from(paths, model, device)



def test_re_planning_options_are_refused_for_a_budget_only_run(tmp_path, capsys):
    """knapspec-budget plans once with its own DP: the re-planning DP's options would be silently unused."""
    base = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "2", "--contexts", "64",
            "--max-new-tokens", "8", "--batches", "1", "--candidate-plans", "0", "--device-tag", "test",
            "--latency-fit", "isolated"]
    for extra in (["--plan-at-start", "--reference-floor", "8"], ["--search-tokens", "3"],
                  ["--dp-attention", "pallas-interpret"], ["--dp-layers", "unrolled"]):
        out = tmp_path / "bad.json"
        assert main(base + ["--methods", "knapspec-budget", *extra, "--out", str(out)]) != 0
        err = capsys.readouterr().err
        assert "options of the re-planning KnapSpec's DP" in err and "profiling" not in err
        assert extra[0] in err and not out.exists()


def test_experiment_runs_every_method_on_the_chosen_attention_backend(tmp_path):
    """--attention-backend: AR and each method decode with that backend (the Pallas kernels, here
    interpreted), the cache rounded to the kernels' blocks; greedy output still equals AR's, the
    config names the backend and the latency profile is saved under a name of its own."""
    out = tmp_path / "ks.json"
    argv = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "2", "--contexts", "64",
            "--max-new-tokens", "16", "--gamma-max", "2", "--gamma-buckets", "1", "--batches", "2",
            "--methods", "knapspec-budget,static-skip", "--candidate-plans", "0", "--candidate-reference-tokens", "8",
            "--attention-budget", "16", "--attention-sinks", "2", "--plan-cost-repeats", "0", "--device-tag", "test",
            "--latency-fit", "isolated", "--max-plan-fraction", "0", "--dtype", "float32",
            "--attention-backend", "pallas-interpret", "--profile-dir", str(tmp_path), "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["config"]["attention_backend"] == "pallas-interpret"
    for method in ("knapspec-budget", "static-skip"):
        assert data["cases"][f"test/summarize/ctx64/b2/{method}"]["identical_to_ar"] is True
    assert (tmp_path / "latency_random-smollm2-135m-shape-L2_float32_pallas-interpret_test_b2_isolated.json").exists()


def test_reprofile_measures_again_and_keeps_the_saved_profile(tmp_path, monkeypatch):
    """--reprofile (both the experiment's flag and generate's): a saved profile is measured again,
    not reused, and the old file is kept beside the new one."""
    import argparse
    import types

    from jaxspec.config import ModelConfig
    from jaxspec.knapspec import latency

    TINY = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=16, dtype="float32", name="tiny-reprofile")
    true = latency.LatencyModel(c1=1.8e-4, c2=6.8e-8, c3=9.8e-5, c0=4.0e-3, v=0.12, u=2.5e-5)
    calls = []
    real = latency.profile_latency_forward

    def clock(key, call):  # steps a call of a device that follows ``true`` exactly (no forward runs)
        kind, n, rows, steps = key
        full, skippable = true.t_step(n, TINY.num_layers), latency.skippable_sublayers(TINY.num_layers)
        step = {"full": full, "plain": full, "noattn": full - skippable * true.t_attn(n),
                "nomlp": full - skippable * true.t_mlp(), "verify": full * (1 + true.v * (rows - 1)),
                "bulk": full + true.t_row(n) * (rows - 1)}[kind]
        return steps * step

    def mocked(cfg, b, contexts, params=None, static_masks=False, half_masks=False, **kwargs):
        calls.append(b)
        return real(cfg, b, contexts, steps_per_call=4, timer=clock, static_masks=static_masks, half_masks=half_masks)

    monkeypatch.setattr(latency, "profile_latency_forward", mocked)
    model = types.SimpleNamespace(source="random:tiny", real=False, config=TINY, params=None)
    parser = argparse.ArgumentParser()
    knapspec_experiment.register(parser.add_subparsers())
    for flags, expected_calls, expected_files in (([], 1, 1), ([], 1, 1), (["--reprofile"], 2, 2)):
        args = parser.parse_args(["knapspec", "--latency-fit", "forward", "--device-tag", "test"] + flags)
        profile, path = knapspec_experiment.latency_profile(args, model, 1, 1024, tmp_path)
        assert len(calls) == expected_calls and len(list(tmp_path.iterdir())) == expected_files, flags
    assert latency.LatencyProfile.load(path) == profile
    # generate's flag reaches load_latency the same way
    gen = argparse.ArgumentParser()
    knapspec_experiment.add_self_spec_args(gen)
    args = gen.parse_args(["--reprofile", "--latency-fit", "forward", "--latency-profile", str(path)])
    knapspec_experiment.load_latency(args, TINY, 1, 1024)
    assert len(calls) == 3 and len(list(tmp_path.iterdir())) == 3
    # --latency-fit forward-static: the masks compiled in, a file of its own beside the dynamic fit's
    args = parser.parse_args(["knapspec", "--latency-fit", "forward-static", "--device-tag", "test"])
    static, static_path = knapspec_experiment.latency_profile(args, model, 1, 1024, tmp_path)
    assert static.method == "forward-static" and static_path.name.endswith("_b1_forward-static.json")
    assert static_path != path and len(calls) == 4 and static_path.exists()
    # --latency-fit forward-static-half: the half masks, compiled in, in a third file
    args = parser.parse_args(["knapspec", "--latency-fit", "forward-static-half", "--device-tag", "test"])
    half, half_path = knapspec_experiment.latency_profile(args, model, 1, 1024, tmp_path)
    assert half.method == "forward-static-half" and half_path.name.endswith("_b1_forward-static-half.json")
    assert half.forward["half_masks"] and half.forward["static_masks"] and len(calls) == 5


def test_bench_plan_times_each_stage_and_rescores_the_finalists_both_ways(tmp_path, capsys):
    """bench-plan: one two-stage plan's stages on a seeded cache, each timed --repeats times, the finalists'
    statistics the same behind conditionals and without them, the masks recorded; a rerun resumes; bad numbers
    are refused in one line before any model loads."""
    out = tmp_path / "knapspec_plan_stages_test_cpu.json"
    argv = ["bench-plan", "--model", "random:smollm2-135m-shape", "--layers", "4", "--dtype", "float32",
            "--contexts", "48,32", "--window", "8", "--search-tokens", "2", "--finalists", "2", "--repeats", "2",
            "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert sorted(data["cases"]) == ["ctx32/r1/w8/s2/f2", "ctx48/r1/w8/s2/f2"]
    for case in data["cases"].values():
        stages = ("boundary_states", "dp_4seg", "dp", "rescore_executed", "rescore_select")
        assert list(case["seconds_min"]) == list(stages)
        assert all(len(case["samples_s"][s]) == 2 and case["seconds_min"][s] > 0 for s in stages)
        assert case["dp_same_masks"] and case["dp_max_cosine_diff"] < 1e-5
        assert case["dp_segments"]["1"] == [[3, case["budget"] + 1]] and len(case["dp_segments"]["4"]) > 1
        assert case["rescore_max_abs_diff"] < 1e-6 and len(case["rescore_stats"]["rescore_select"]) == 2
        assert len(case["finalist_masks"]["skip_attn"]) == len(case["finalist_masks"]["skip_mlp"]) == 2
        assert case["select_over_executed"] == pytest.approx(
            case["seconds_min"]["rescore_select"] / case["seconds_min"]["rescore_executed"])
    capsys.readouterr()
    assert main(argv) == 0 and "[resume] 2 case(s)" in capsys.readouterr().err
    assert json.loads(out.read_text())["cases"] == data["cases"]  # resumed: nothing measured again
    for extra, message in ((["--search-tokens", "8"], "--search-tokens=8 must be below --window=8"),
                           (["--weights", "5"], "--weights '5'"), (["--finalists", "0"], "--finalists=0"),
                           (["--dp-segments", "4,4"], "expected distinct integers >= 1"),
                           (["--model", "smollm2-135m"], "--layers is for random:PRESET")):
        assert main(argv[:-2] + extra + ["--out", str(tmp_path / "bad.json")]) != 0
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()
    assert "dp_unrolled" not in data["config"]  # named only when set: files from before the flag resume
    unrolled = tmp_path / "knapspec_plan_stages_unrolled_cpu.json"
    assert main(argv[:-2] + ["--contexts", "32", "--dp-unrolled", "--out", str(unrolled)]) == 0
    case = json.loads(unrolled.read_text())["cases"]["ctx32/r1/w8/s2/f2"]
    assert list(case["seconds_min"])[1:4] == ["dp_4seg", "dp", "dp_unrolled"]
    assert case["dp_same_masks"] and case["dp_max_cosine_diff"] < 1e-5  # the unrolled DP finds the scan's candidates


def test_bench_plan_rescores_the_skip_sets_of_a_results_file(tmp_path, capsys):
    """--masks-from: the finalists are the distinct plans' skip sets of a knapspec results file (the first one
    repeated to fill), rescored both ways with the same statistics; a file whose plans skip a layer the model lacks,
    or with no plan, is refused in one line."""
    plans = tmp_path / "knapspec_plans_test_cpu.json"
    plan = {"skip_attn": [1, 2], "skip_mlp": [1]}
    plans.write_text(json.dumps({"cases": {"a": {"plans": [plan, plan]}, "b": {"tau": 1.0}}}))
    out = tmp_path / "knapspec_plan_stages_masks_test_cpu.json"
    argv = ["bench-plan", "--model", "random:smollm2-135m-shape", "--layers", "4", "--dtype", "float32",
            "--contexts", "32", "--window", "8", "--search-tokens", "2", "--finalists", "2", "--repeats", "1",
            "--dp-segments", "1", "--masks-from", str(plans), "--out", str(out)]
    assert main(argv) == 0
    case = json.loads(out.read_text())["cases"]["ctx32/r1/w8/s2/f2"]
    assert case["finalist_masks"] == {"skip_attn": [[1, 2], [1, 2]], "skip_mlp": [[1], [1]]}
    assert case["rescore_max_abs_diff"] < 1e-6
    capsys.readouterr()
    plans.write_text(json.dumps({"cases": {"a": {"plans": [{"skip_attn": [5], "skip_mlp": []}]}}}))
    assert main(argv[:-2] + ["--out", str(tmp_path / "bad.json")]) != 0
    assert "a plan skips layer 5, but the model has 4 layers" in capsys.readouterr().err
    plans.write_text(json.dumps({"cases": {}}))
    assert main(argv[:-2] + ["--out", str(tmp_path / "bad.json")]) != 0
    assert "no plan with skip_attn / skip_mlp" in capsys.readouterr().err
    missing = argv[:-4] + ["--masks-from", str(tmp_path / "none.json"), "--out", str(tmp_path / "bad.json")]
    assert main(missing) != 0 and "no such file" in capsys.readouterr().err


def test_the_cli_defaults_of_dp_segments_and_weight_cap_are_the_dps():
    """--[knapspec-]dp-segments and --[knapspec-]weight-cap default to the DP's own (the CLI module keeps copies to load
    no JAX)."""
    assert knapspec_experiment.DP_SEGMENTS == dp.DEFAULT_SEGMENTS == KnapSpecConfig().dp_segments
    assert knapspec_experiment.WEIGHT_CAP == dp.WEIGHT_CAP == KnapSpecConfig().weight_cap
    assert knapspec_experiment.DP_LAYERS == dp.DP_LAYERS and KnapSpecConfig().dp_layers == dp.DP_LAYERS[0]


def test_candidate_plans_timed_in_pairs(tmp_path, capsys):
    """--candidate-repeats N: each candidate plan is timed in N (AR, plan) pairs; the plan's speed-up and tokens/s are
    the median pair's, every pair is kept, the correlation reads the medians, and the config names the option only
    when set. N < 1 is refused before any work."""
    out = tmp_path / "ks.json"
    argv = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "4", "--contexts", "64",
            "--max-new-tokens", "16", "--gamma-max", "2", "--gamma-buckets", "1", "--batches", "1",
            "--methods", "knapspec", "--candidate-plans", "2", "--candidate-repeats", "3",
            "--candidate-reference-tokens", "8", "--plan-cost-repeats", "0", "--device-tag", "test",
            "--latency-fit", "isolated", "--max-plan-fraction", "0", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["config"]["candidate_repeats"] == 3
    fixed = {k: v for k, v in data["cases"].items() if "/fixed/" in k}
    assert fixed
    for record in fixed.values():
        ratios = sorted(p["speedup_vs_ar"] for p in record["pairs"])
        assert len(ratios) == 3 and record["speedup_vs_ar"] == ratios[1]
        median = next(p for p in record["pairs"] if p["speedup_vs_ar"] == ratios[1])
        assert record["tokens_per_s"] == median["tokens_per_s"]
    (corr,) = [v for k, v in data["cases"].items() if k.endswith("/correlation")]
    assert sorted(corr["measured_speedup"]) == sorted(r["speedup_vs_ar"] for r in fixed.values())
    capsys.readouterr()
    assert main(argv[:argv.index("--candidate-repeats") + 1] + ["0"] + argv[argv.index("--candidate-repeats") + 2:]
                + ["--out", str(tmp_path / "bad.json")]) == 2
    assert "--candidate-repeats 0" in capsys.readouterr().err and not (tmp_path / "bad.json").exists()


def test_candidate_plans_beyond_the_finalists_are_warned_before_any_work(capsys):
    """A two-stage plan (--search-tokens) hands back only its --finalists plans as candidates: asking for more
    candidate plans than finalists prints a one-line warning naming both before anything runs."""
    argv = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "4", "--contexts", "64",
            "--candidate-plans", "8", "--search-tokens", "3", "--finalists", "2",
            # a conflict checked after the warning, so that the run stops there
            "--plan-cost-scale", "2", "--plan-cost-scale-from", "x.json"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--candidate-plans=8" in err and "--finalists=2" in err and "give --finalists >= 8" in err
    assert main(argv[:argv.index("--finalists") + 1] + ["8"] + argv[argv.index("--finalists") + 2:]) == 2
    assert "--finalists=" not in capsys.readouterr().err


def test_reprice_tpt_prices_the_candidates_again_both_ways(tmp_path, capsys):
    """reprice-tpt: a correlation run's candidates priced as the planner prices them, by the run's own profile and
    any other, with the DP's alpha and with the measured acceptance; throughput generated from the measured
    acceptance makes that pricing's Pearson 1; bad files are refused in one line before any pricing."""
    from jaxspec.knapspec.latency import LatencyModel
    from jaxspec.knapspec.planner import objective_table

    fit = {"c1": 4e-5, "c2": 4.5e-10, "c3": 4.9e-5, "c0": 2.5e-4, "v": 0.016, "a": 0.86}
    model, n = LatencyModel(**fit), 32320.0
    masks = [[[False, False], [s >= 1, False], [s >= 2, s >= 3], [False, False]] for s in range(4)]
    alphas, acceptance = [0.9, 0.8, 0.7, 0.6], [0.6, 0.9, 0.7, 0.8]

    def tpt(m, a):
        return float(objective_table(np.asarray([m], bool), [a], model.t_attn(n), model.t_mlp(), (1,), "tpt",
                                     model.t_token(n), model.v, model.a)[0, 0])

    tput = [tpt(m, a) for m, a in zip(masks, acceptance)]
    run = {"latency_b1": {"path": "own.json", "method": "forward-static", "fit": fit},
           "cases": {"h100/summarize/ctx32000/b1/candidates": {"plan": {"n": n}, "candidates": [
                         {"mask": m, "alpha": a, "gamma": 1} for m, a in zip(masks, alphas)]},
                     "h100/summarize/ctx32000/b1/correlation": {"plans": 4, "measured_acceptance": acceptance,
                                                                "tokens_per_s": tput}}}
    source, other = tmp_path / "run.json", tmp_path / "half.json"
    source.write_text(json.dumps(run))
    from jaxspec.knapspec import latency
    from jaxspec.config import ModelConfig
    tiny = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=16, dtype="float32", name="tiny-reprice")
    profile = latency.profile_latency_forward(tiny, 1, (128, 256, 512), steps_per_call=2, warmup=1, repeats=1,
                                              bulk_rows=(), half_masks=True,
                                              timer=lambda key, call: key[3] * 1e-3 * (1 + key[1] / 512))
    profile.save(other)
    out = tmp_path / "repriced.json"
    assert main(["reprice-tpt", "--from", str(source), "--profiles", str(other), "--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["h100/summarize/ctx32000/b1/repriced"]
    assert [(r["profile"], r["alpha"]) for r in case["rows"]] == [
        ("own.json", "dp"), ("own.json", "measured"), (str(other), "dp"), (str(other), "measured")]
    own_dp, own_measured = case["rows"][0], case["rows"][1]
    assert own_measured["pearson_vs_throughput"] == pytest.approx(1.0)
    assert own_dp["predicted_tpt"] == pytest.approx([tpt(m, a) for m, a in zip(masks, alphas)])
    assert case["rows"][2]["method"] == "forward-half"
    capsys.readouterr()
    assert main(["reprice-tpt", "--from", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x.json")]) == 2
    assert "--from=" in capsys.readouterr().err
    assert main(["reprice-tpt", "--from", str(source), "--profiles", "missing.json", "--out", str(tmp_path / "y.json")]) == 2
    assert "no such latency profile missing.json" in capsys.readouterr().err


def test_choice_table_of_knapspec_runs_decides_whether_a_run_plans(tmp_path, capsys):
    """A knapspec run's results become a choice table (`choice-table --from`, keyed by method, context bucket and
    batch); a run deciding from a table whose entry is below 1 + margin makes no plan and decodes plainly (greedy:
    AR's tokens), and records the decision; such a run joins a table only as an outcome, and only where the
    table chose to plan. Tables of another model or of a separate draft are refused before any model loads."""
    from experiments.choice_table import choice_table_from
    from jaxspec.decoding.arbitration import ChoiceTable

    base = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "2", "--contexts", "60",
            "--max-new-tokens", "12", "--gamma-max", "2", "--gamma-buckets", "1", "--batches", "2",
            "--methods", "knapspec", "--candidate-plans", "0", "--plan-cost-repeats", "0", "--max-plan-fraction", "0",
            "--reference-floor", "8", "--plan-at-start", "--device-tag", "test", "--latency-fit", "isolated"]
    plain = tmp_path / "plain.json"
    assert main(base + ["--out", str(plain)]) == 0
    ran = json.loads(plain.read_text())["cases"]["test/summarize/ctx60/b2/knapspec"]
    assert ran["plans"] and ran["choice_table"] is None
    table = choice_table_from([str(plain)])
    entry = table.lookup("knapspec", 64, 2)
    assert entry["speedup"] == pytest.approx(ran["speedup_vs_ar"]) and table.meta["draft"] == "self"
    assert table.meta["target"] == "random:smollm2-135m-shape"
    # a table saying KnapSpec did not pay at (64, 2)
    slow = tmp_path / "slow.json"
    ChoiceTable([dict(entry, speedup=0.8)], meta=table.meta).save(slow)
    decided = tmp_path / "decided.json"
    assert main(base + ["--choice-table", str(slow), "--out", str(decided)]) == 0
    data = json.loads(decided.read_text())
    case = data["cases"]["test/summarize/ctx60/b2/knapspec"]
    assert data["config"]["choice_table"] == str(slow)
    assert case["choice_table"]["choice"] == "ar" and case["choice_table"]["table_speedup"] == pytest.approx(0.8)
    assert case["plans"] == [] and case["rounds"] == 0 and case["identical_to_ar"] is True
    with pytest.raises(ValueError, match="give it with --outcomes"):
        choice_table_from([str(decided)])
    # as an outcome it adds nothing: the table chose plain decoding there
    assert len(choice_table_from([str(plain)], outcomes=[str(decided)]).lookup("knapspec", 64, 2)["measured"]) == 1
    with pytest.raises(ValueError, match="was not measured deciding from a choice table"):
        choice_table_from([str(plain)], outcomes=[str(plain)])
    capsys.readouterr()
    other = tmp_path / "other.json"
    ChoiceTable([entry], meta=dict(table.meta, target="qwen2.5-coder-1.5b")).save(other)
    pair = tmp_path / "pair.json"
    ChoiceTable([entry], meta=dict(table.meta, draft="qwen2.5-coder-0.5b")).save(pair)
    for path, message in ((other, "measured with target 'qwen2.5-coder-1.5b'"),
                          (pair, "measured with draft 'qwen2.5-coder-0.5b', this run's draft is 'self'"),
                          (tmp_path / "none.json", "no such file")):
        assert main(base + ["--choice-table", str(path), "--out", str(tmp_path / "bad.json")]) != 0
        err = capsys.readouterr().err
        assert message in err and "profiling" not in err
    assert not (tmp_path / "bad.json").exists()
