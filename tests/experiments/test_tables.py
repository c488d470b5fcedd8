"""The committed results, their index, the generated docs and the suite definitions agree."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from experiments import tables

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS = REPO / "experiments" / "results"
SUITES = sorted((REPO / "experiments" / "suites").glob("*.toml"))
RUN_TAG = re.compile(r"_s[0-9]|logs_s|profiles_s|session")
# <experiment>/<experiment>_<model-or-shape>[_<context>][_b<batch>][_<detail>]_<device>.json
RESULT_NAME = re.compile(r"^(?P<exp>[a-z_]+)/(?P=exp)(_[A-Za-z0-9.+-]+)+_(h200|h100|cpu)\.(json|png)$")
# latency profiles, named by the knapspec experiment itself, live in one folder per run
PROFILE_NAME = re.compile(r"^knapspec/latency_[A-Za-z0-9._-]+/latency_[A-Za-z0-9._-]+\.json$")


def committed_results():
    listed = subprocess.run(["git", "ls-files", "experiments/results"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    return [path[len("experiments/results/"):] for path in listed]


def suite_outs():
    outs = []
    for path in SUITES:
        for step in tomllib.loads(path.read_text())["steps"]:
            argv = shlex.split(step["run"])
            if "--out" in argv:
                outs.append((path.name, step["name"], argv[argv.index("--out") + 1]))
    return outs


def test_check_passes_on_the_committed_tree():
    done = subprocess.run([sys.executable, "-m", "experiments.tables", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr


def test_index_entries_are_read_from_their_sources():
    index = json.loads((RESULTS / "index.json").read_text())
    assert len(index) == len(tables.FIGURES) and len({e["key"] for e in index}) == len(index)
    for entry in index:
        assert set(entry) == {"key", "value", "unit", "device", "command", "source"}
        assert (REPO / entry["source"]).is_file(), entry["source"]
        figure = tables.BY_KEY[entry["key"]]
        assert entry["value"] == figure.value(), entry["key"]
        assert entry["source"] == f"experiments/results/{figure.source}"
        assert entry["command"].split("python -m experiments.run ", 1)[1] in {
            step for _, _, step in _suite_runs()}, entry["key"]


def _suite_runs():
    for path in SUITES:
        for step in tomllib.loads(path.read_text())["steps"]:
            yield path.name, step["name"], step["run"]


def test_readme_block_is_replaced_between_the_markers_only():
    text = f"# jaxspec\n\nintro\n{tables.BEGIN}\nold numbers\n{tables.END}\n\n## Next\n"
    new = tables.readme_with_block(text)
    assert new.startswith("# jaxspec\n\nintro\n" + tables.BEGIN) and new.endswith(tables.END + "\n\n## Next\n")
    assert "old numbers" not in new
    figure = tables.BY_KEY[tables.README_KEYS[0]]
    assert f"| {figure.label} | {tables.fmt(figure.value(), figure.unit)} |" in new
    assert tables.readme_with_block(new) == new
    assert tables.readme_with_block("# jaxspec, no markers\n") is None


def test_extractor_reads_a_json_path_and_rejects_ambiguous_selections():
    data = {"cases": {"ctx8/b1": {"rows": [{"method": "ar", "x": 1.0}, {"method": "dustin", "x": 2.5}]}}}
    assert tables.read_path(data, ("cases", "ctx8/b1", "rows", {"method": "dustin"}, "x")) == 2.5
    with pytest.raises(KeyError):
        tables.read_path(data, ("cases", "ctx8/b1", "rows", {"x": 3.0}, "x"))


@pytest.mark.parametrize("suite", SUITES, ids=lambda p: p.stem)
def test_suite_parses_with_unique_steps_writing_under_results(suite):
    data = tomllib.loads(suite.read_text())
    assert isinstance(data["description"], str) and data["description"].strip()
    assert isinstance(data["device"], str) and data["device"]
    assert all(isinstance(name, str) for name in data.get("needs", []))
    names = [step["name"] for step in data["steps"]]
    assert names and len(names) == len(set(names)), names
    existing = set(committed_results())
    for step in data["steps"]:
        assert set(step) <= {"name", "run", "timeout_s", "env"}, step
        argv = shlex.split(step["run"])
        assert argv[0] and not argv[0].startswith("-") and "--out" in argv, step["name"]
        out = argv[argv.index("--out") + 1]
        assert out.startswith("experiments/results/"), out
        relative = out[len("experiments/results/"):]
        assert relative in existing or RESULT_NAME.match(relative), out


def test_every_committed_result_is_written_by_a_suite_step():
    outs = {out for _, _, out in suite_outs()}
    for path in committed_results():
        if path == "index.json" or PROFILE_NAME.match(path) or path in tables.PLOTS or path.endswith(".png"):
            continue
        assert f"experiments/results/{path}" in outs, path


def test_results_are_named_by_content_without_run_tags():
    for path in committed_results():
        assert not RUN_TAG.search(path), path
        assert path == "index.json" or RESULT_NAME.match(path) or PROFILE_NAME.match(path), path


def test_tables_imports_no_experiment_module():
    """Every module of the experiments.tables package imports its siblings at most: no experiment, jaxspec or
    pallas_kernels module."""
    paths = sorted((REPO / "experiments" / "tables").glob("*.py"))
    assert len(paths) > 2
    for path in paths:
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not any(node.level for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)), path.name
        outside = {name for name in imported if name.startswith(("experiments", "jaxspec", "pallas_kernels"))
                   and name != "experiments.tables" and not name.startswith("experiments.tables.")}
        assert not outside, (path.name, outside)


def test_divergence_note_sorts_diverging_items_by_what_the_answers_do():
    """Identical outputs, divergence with both answers right, with both wrong, and a changed answer."""
    def dense(accuracy):
        return {"accuracy": accuracy, "tokens": [1, 2, 3]}

    def run(accuracy, first):
        return {"method": "dustin-h", "budget": 512, "accuracy": accuracy, "first_divergence": first}

    cases = {}
    for item, (d, r, first) in enumerate(((1.0, 1.0, None), (1.0, 1.0, 4), (0.0, 0.0, 1), (1.0, 0.0, 2))):
        cases[f"evaluation/passkey/400/i{item}/dense"] = dense(d)
        cases[f"evaluation/passkey/400/i{item}/dustin-h/k512"] = run(r, first)
    note = tables.divergence_note(cases)
    assert "1 of 4 outputs equal dense; of the 3 that leave it (first differing token at 1, 2, 4)" in note
    assert "1 still give the correct answer" in note and "1 are items dense fails too" in note
    assert "1 differ from dense in retrieval" in note


def test_the_tables_tail_margin_is_the_controllers_default():
    """experiments.tables imports no jaxspec module, so it keeps its own copy of the guard's margin (in
    experiments/tables/inputs.py): they must agree."""
    import inspect

    from experiments import tables
    from jaxspec.decoding.arbitration import MeasuredChoiceController

    default = inspect.signature(MeasuredChoiceController).parameters["table_tail_margin"].default
    assert tables.TABLE_TAIL_MARGIN == default


def test_m_per_length_rows_score_a_run_against_the_single_m_run_on_the_same_items(monkeypatch):
    """The length's m and the coverage rule around it are scored against the single-m run's fixed m and oracle on
    the items both runs decoded densely alike; runs of other items, or with no such item, are refused."""
    def dense(arr, tokens=(1, 2, 3)):
        return {"task": "t0", "context": 32000, "tokens": list(tokens), "arr": arr,
                "m_rule": {"dustin-h-cov/k128": {"m_per_round": [60, 70], "selection_cost_ratio": 1.2}}}

    def decode(method, m):
        return {"method": method, "budget": 128, "m": m, "match_rate": 0.5, "accuracy": 1.0}

    single = {"t0/dense": dense({"dustin-h/k128": 0.60, "dustin-h-cov/k128": 0.61, "dustin-h-oracle/k128": 0.64}),
              "t0/dustin-h/k128": decode("dustin-h", 73)}
    per_length = {"t0/dense": dense({"dustin-h/k128": 0.62, "dustin-h-cov/k128": 0.63}),
                  "t0/dustin-h/k128": decode("dustin-h", 63)}
    files = {"single.json": {"cases": single}, "length.json": {"cases": per_length}}
    monkeypatch.setattr(tables.inputs, "load", lambda name: files[name])
    (row,) = tables.m_per_length_rows("length.json", "single.json")
    assert (row["m_fixed"], row["m_length"]) == (73, 63)
    assert row["gap_closed_coverage"] == pytest.approx(0.25)
    assert row["gap_closed_length"] == pytest.approx(0.5)
    assert row["gap_closed_length_coverage"] == pytest.approx(0.75)
    assert row["selection_ratio_length_coverage"] == pytest.approx(1.2)
    # a second item both runs decoded apart (two GPUs can round it differently) is left out of every mean
    single["t1/dense"] = dense({"dustin-h/k128": 0.10, "dustin-h-cov/k128": 0.10, "dustin-h-oracle/k128": 0.90})
    per_length["t1/dense"] = dense({"dustin-h/k128": 0.90, "dustin-h-cov/k128": 0.90}, tokens=(1, 2, 4))
    single["t1/dustin-h/k128"], per_length["t1/dustin-h/k128"] = decode("dustin-h", 73), decode("dustin-h", 63)
    (row,) = tables.m_per_length_rows("length.json", "single.json")
    assert (row["items"], row["items_differing"]) == (1, 1)
    assert row["gap_closed_length"] == pytest.approx(0.5)
    per_length["t0/dense"] = dense({"dustin-h/k128": 0.62}, tokens=(1, 2, 4))
    with pytest.raises(ValueError, match="no item's dense tokens"):
        tables.m_per_length_rows("length.json", "single.json")
    files["length.json"] = {"cases": {"t1/dense": dense({})}}
    with pytest.raises(ValueError, match="not the items"):
        tables.m_per_length_rows("length.json", "single.json")


def test_m_per_length_held_rows_compare_on_the_items_the_held_run_has(monkeypatch):
    """The rule deciding every third round is scored on the items the (possibly still resuming) held run decoded like
    the per-length run, and every other column is restricted to those items; the run's planned items are reported."""
    def dense(arr, rule, tokens=(1, 2, 3)):
        return {"task": "t", "context": 32000, "tokens": list(tokens), "arr": arr,
                "m_rule": {f"{rule}/k128": {"m_per_round": [60, 70], "selection_cost_ratio": 1.5}}}

    def decode(method):
        return {"method": method, "budget": 128, "m": 63, "match_rate": 1.0, "accuracy": 1.0}

    single, per_length, held = {}, {}, {}
    for item, (fixed, oracle) in {"t0": (0.60, 0.64), "t1": (0.10, 0.90)}.items():
        single[f"{item}/dense"] = dense({"dustin-h/k128": fixed, "dustin-h-cov/k128": fixed,
                                         "dustin-h-oracle/k128": oracle}, "dustin-h-cov")
        per_length[f"{item}/dense"] = dense({"dustin-h/k128": fixed + 0.02, "dustin-h-cov/k128": fixed + 0.03},
                                            "dustin-h-cov")
        single[f"{item}/dustin-h/k128"] = per_length[f"{item}/dustin-h/k128"] = decode("dustin-h")
    held["t0/dense"] = dense({"dustin-h/k128": 0.62, "dustin-h-cov-held/k128": 0.61}, "dustin-h-cov-held")
    held["t0/dustin-h-cov-held/k128"] = decode("dustin-h-cov-held")
    files = {"single.json": {"cases": single}, "length.json": {"cases": per_length},
             "held.json": {"cases": held, "config": {"items": "32000:6"}}}
    monkeypatch.setattr(tables.inputs, "load", lambda name: files[name])
    (row,), measured, planned = tables.m_per_length_held_rows("held.json", "length.json", "single.json")
    assert (measured, planned, row["items"]) == (1, 6, 1)
    assert row["arr_fixed"] == pytest.approx(0.60) and row["arr_oracle"] == pytest.approx(0.64)  # t1 left out
    assert row["gap_closed_length_held"] == pytest.approx(0.25)
    assert row["gap_closed_length_coverage"] == pytest.approx(0.75)
    assert row["selection_ratio_length_held"] == pytest.approx(1.5) and row["match_length_held"] == 1.0
    held["t0/dense"]["tokens"] = [9]  # decoded apart from the per-length run: nothing to compare
    assert tables.m_per_length_held_rows("held.json", "length.json", "single.json") == ([], 1, 6)


def test_plain_idle_sentence_tells_device_work_from_waiting():
    """A traced KnapSpec run whose plain steps ran slower than AR's: the busy and wall time beyond AR's outside the
    plan's window, and the per-chunk fit where the run has it (a negative intercept is noise, not a cost)."""
    case = {"time_split_measured": {"plain_step_over_ar_step": 1.11, "plain_steps": 255, "plain_stretches": 3,
                                    "plain_stretch_fit": {"fixed_s": 0.012, "step_s": 0.003, "step_over_ar_step": 1.02}}}
    ar = {"busy_s": 0.778, "span_s": 1.090}
    ks = {"busy_s": 0.813, "span_s": 1.243, "windows": {"jaxspec.knapspec.plan": {"busy_s": 0.025, "wall_s": 0.070}}}
    text = tables.knapspec._plain_idle_sentence(case, ar, ks)
    assert "busy 10 ms more" in text and "83 ms longer" in text and "12.0 ms fixed a stretch" in text
    case["time_split_measured"]["plain_stretch_fit"]["fixed_s"] = -0.004
    assert "no fixed cost a stretch" in tables.knapspec._plain_idle_sentence(case, ar, ks)
    case["time_split_measured"].update(plain_stretch_fit=None, chunks=[], plain_stretches=1)
    assert "have one length: no fit" in tables.knapspec._plain_idle_sentence(case, ar, ks)
    del case["time_split_measured"]["plain_stretch_fit"], case["time_split_measured"]["chunks"]
    assert "predates the engine's per-chunk log" in tables.knapspec._plain_idle_sentence(case, ar, ks)
    case["time_split_measured"]["plain_step_over_ar_step"] = 1.02  # as fast as AR: nothing to explain
    assert tables.knapspec._plain_idle_sentence(case, ar, ks) == ""


def test_probe_text_names_the_price_each_probe_used():
    """A mean-priced probe names the better of the measured and modelled plain rates; a two-stretch probe names
    both sides' per-unit times by the stretches' difference beside their means, and that the model did not decide."""
    mean = {"rounds": 8, "speculative_tokens": 16, "speculative_s": 0.0576, "speculative_tokens_per_s": 278.0,
            "ar_tokens_per_s": 293.0, "ar_tokens_per_s_measured": 259.0, "ar_tokens_per_s_model": 293.0,
            "ar_steps": 8, "choice": "ar"}
    text = tables.knapspec._probe_text(mean)
    assert "7.2 ms a round" in text and "the better of 259 measured over 8 steps and the latency model's 293" in text
    assert text.endswith("so it decoded plainly")
    two = dict(mean, speculative_round_s=0.0049, speculative_round_s_mean=0.0072, speculative_tokens_per_s=408.0,
               ar_tokens_per_s=346.0, ar_tokens_per_s_measured=346.0, ar_step_s=0.00289, ar_step_s_mean=0.0041,
               choice="speculative")
    text = tables.knapspec._probe_text(two)
    assert "priced as two stretches, ran 408 tokens/s (4.90 ms a round by the stretches' difference, 7.20 ms" in text
    assert "2.89 ms a step by the two stretches, 4.10 ms on average over the 8 steps" in text
    assert "the latency model's rate 293, not used" in text and text.endswith("so it kept the plan")


def test_knapspec_loss_sentence_splits_a_drafting_runs_loss_against_ar():
    """A batch-1 KnapSpec run whose plan drafted: its loss against AR split into planning, the plain stretches and
    the rounds beyond AR's pace (ahead of it when negative), the controller; and the model's step prices against the
    measured ones. Runs that decoded plainly or lack the chunk log get nothing."""
    case = {"ar_step_s": 0.003, "ar_steps": 64, "tau": 1.5, "rounds": 128, "ar_decode_s": 0.768,
            "timings": {"decode_s": 0.9}, "predicted_ar_step_s": 0.0034,
            "plans": [{"gamma_star": 1}],
            "time_split_measured": {"plain_stretches_s": 0.2, "rounds_s": 0.57, "plan_s": 0.1, "controller_s": 0.03,
                                    "chunks": [{"kind": "plain", "units": 64, "seconds": 0.2},
                                               {"kind": "rounds", "units": 128, "seconds": 0.57}]},
            "draft_step_check": {"static_s": 0.0025, "predicted_s": 0.002, "n_skip_attn": 14, "n_skip_mlp": 6},
            "latency_prediction": {"step_s": 0.0032}}
    text = tables.knapspec._knapspec_loss_sentence(case, "h100/summarize/ctx32000/b1/knapspec")
    assert "32000-token run lost 132 ms against AR's 768 ms: planning 100 ms" in text
    assert "the plain stretches 8 ms beyond AR's pace for their 64 tokens" in text
    assert "the rounds 6 ms ahead of it for their 192 tokens (tau 1.50, the last call 4.45 ms a round" in text
    assert "saved 0.50 ms of AR's measured step against 1.20 ms predicted" in text
    assert "committed 337 tokens/s at the run's tau against AR's 333 (1.01x)" in text
    assert tables.knapspec._knapspec_loss_sentence(case, "h100/summarize/ctx32000/b16/knapspec") == ""
    case["plans"] = [{"gamma_star": 0}]
    assert tables.knapspec._knapspec_loss_sentence(case, "h100/summarize/ctx32000/b1/knapspec") == ""


def test_repriced_tpt_tells_which_side_of_the_prediction_holds_the_correlation_back(tmp_path, monkeypatch):
    """The sentence on a reprice-tpt file: the run's own profile with the DP's alpha and with the measured
    acceptance, each further profile; the verdict only where the acceptance side gains >= 0.1."""
    rows = [{"profile": "own.json", "method": "forward-static", "alpha": "dp", "pearson_vs_throughput": 0.63},
            {"profile": "own.json", "method": "forward-static", "alpha": "measured", "pearson_vs_throughput": 0.87},
            {"profile": "p/half.json", "method": "forward-static-half", "alpha": "dp", "pearson_vs_throughput": 0.65},
            {"profile": "p/half.json", "method": "forward-static-half", "alpha": "measured",
             "pearson_vs_throughput": None}]
    (tmp_path / "knapspec").mkdir()
    path = tmp_path / "knapspec" / "r.json"
    path.write_text(json.dumps({"cases": {"h100/summarize/ctx32000/b1/repriced": {"rows": rows}}}))
    monkeypatch.setattr(tables.inputs, "RESULTS", tmp_path)
    text = tables.knapspec_plans._repriced_tpt("knapspec/r.json", "h100", 32000)
    assert "by the same latency model, r = 0.87 with tokens/s against 0.63 with the DP's alpha" in text
    assert "by the forward-static-half profile (`p/half.json`) r = 0.65 with the DP's alpha, n/a with the measured" in text
    assert text.endswith("the DP's alpha, more than the latency model, holds the prediction back.")
    rows[1]["pearson_vs_throughput"] = 0.70  # a new file: tables.inputs.load caches what it read
    (tmp_path / "knapspec" / "r2.json").write_text(json.dumps({"cases": {"h100/summarize/ctx32000/b1/repriced":
                                                                          {"rows": rows}}}))
    assert "holds the prediction back" not in tables.knapspec_plans._repriced_tpt("knapspec/r2.json", "h100", 32000)
    assert tables.knapspec_plans._repriced_tpt("knapspec/r.json", "h100", 16000) == ""
    assert tables.knapspec_plans._repriced_tpt("", "h100", 32000) == "" == tables.knapspec_plans._repriced_tpt(
        "knapspec/none.json", "h100", 32000)


def test_plain_table_reads_a_bench_plain_file_and_names_the_missing_step(tmp_path, monkeypatch):
    """A bench-plain file (as the experiment writes it, tests/experiments/test_cli.py) becomes a table per case, each
    variant's step against the AR loop's; a missing file names its suite and step; the figures follow the file."""
    from experiments.run import main

    out = tmp_path / "bench_plain" / "b.json"
    assert main(["bench-plain", "--shape", "smollm2-135m-shape", "--layers", "2", "--context", "64", "--batches", "2",
                 "--new-tokens", "8", "--repeats", "1", "--attention-backend", "xla", "--out", str(out)]) == 0
    monkeypatch.setattr(tables.inputs, "RESULTS", tmp_path)
    monkeypatch.setattr(tables.inputs, "BENCH_PLAIN", {"h100": ("bench_plain/b.json", "h100-long-context"),
                                                       "h200": ("bench_plain/none.json", "h200-ar-decode")})
    text = tables.plain_table()
    assert "on an H100 (smollm2-135m-shape/ctx64/b2/n8, random weights; `bench_plain/b.json`): each timed at 2 and 8" in text
    assert "| the AR loop |" in text and "| 1.000 |" in text and "| the stretch with a static loop bound |" in text
    assert "on the H200 (bench-plain, suite h200-ar-decode step plain-vs-ar-32k): not measured yet." in text


def test_alpha_against_measured_reports_the_error_and_the_gap():
    plan = {"alpha": 0.75, "reference_tokens": 64}
    text = tables.knapspec._alpha_against_measured(plan, {"acceptance_rate": 0.67, "rounds": 9})
    assert "+/- 0.05, one standard error on its 64 reference tokens" in text
    assert "accepted 0.67 of its drafted tokens over 9 rounds, 0.08 above the estimate: outside the 0.05 target" in text
    assert "within the 0.05 target" in tables.knapspec._alpha_against_measured(plan, {"acceptance_rate": 0.72,
                                                                                      "rounds": 50})
    # no rounds ran (the plan decoded plainly), or no reference tokens were recorded: nothing to compare
    assert tables.knapspec._alpha_against_measured(plan, {"acceptance_rate": 0.0, "rounds": 0}) == ""
    assert tables.knapspec._alpha_against_measured({"alpha": 0.7}, {"acceptance_rate": 0.7, "rounds": 5}) == ""


def test_shape_layers_match_the_presets():
    """The tables' per-layer product counts divide by the preset's layer count (the tables import no jaxspec)."""
    from experiments.tables import inputs
    from jaxspec.config import preset

    assert {shape: preset(shape).num_layers for shape in inputs.SHAPE_LAYERS} == inputs.SHAPE_LAYERS
    assert {shape for _, shape, _ in inputs.DECODE_PROJECTIONS} <= set(inputs.SHAPE_LAYERS)
