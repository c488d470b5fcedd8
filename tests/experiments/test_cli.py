"""The experiments command line: bad input refused up front with one line, results never
overwritten, the suite runner, the demo, and the experiments' one-way imports."""

import argparse
import ast
import json
import pathlib

import pytest

from experiments import common, generate, registry
from experiments.run import main
from experiments.suite import Step

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY_PROMPT = "Once upon a time, in a land far away, there lived a curious fox. " * 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-layer tiny Llama HF folder with a character tokenizer (loads in a second)."""
    import torch

    from tests.conftest import tiny_llama_folder

    torch.set_num_threads(1)
    return tiny_llama_folder(tmp_path_factory.mktemp("cli"), 0, "tiny")


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error line"
    return err[-1]


# ---------------------------------------------------------------------------- --batch-file
def _prompts(tmp_path, text):
    path = tmp_path / "batch.jsonl"
    path.write_text(text)
    return common.read_batch_file(str(path))


def test_batch_file_forms(tmp_path):
    assert _prompts(tmp_path, '{"prompt": "hello there"}\n') == ["hello there"]  # one JSONL line: not its keys
    assert _prompts(tmp_path, '{\n  "prompt": "pretty"\n}\n') == ["pretty"]
    assert _prompts(tmp_path, '{"prompt": "a"}\n\n{"prompt": "b"}\n"c"\n') == ["a", "b", "c"]
    assert _prompts(tmp_path, '["x", {"prompt": "y"}]') == ["x", "y"]
    assert _prompts(tmp_path, '[\n "x",\n "y"\n]\n') == ["x", "y"]


@pytest.mark.parametrize("text,message", [
    ('{"text": "no prompt field"}\n', 'object without a "prompt" field'),
    ('{"prompt": 3}\n', '"prompt" is a int, not a string'),
    ('["a", 5]', "item 1: a JSON int is not a prompt"),
    ('{"prompt": "a"}\n[1, 2]\n', ":2: a JSON list is not a prompt"),
    ('{"prompt": "a"}\nnot json\n', ":2: not JSON"),
    ("\n\n", "no prompts found"),
    ("[1, 2", "not a JSON list"),
])
def test_batch_file_bad_entries(tmp_path, text, message):
    with pytest.raises(ValueError, match="--batch-file takes") as err:
        _prompts(tmp_path, text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_batch_file_bad_entry_from_the_cli_before_loading(tmp_path, capsys):
    path = tmp_path / "b.jsonl"
    path.write_text('{"text": "x"}\n')
    assert main(["generate", "--model", "/no/such/model", "--batch-file", str(path)]) == 2
    assert 'without a "prompt" field' in _error(capsys)  # read before the (missing) model is touched


# ---------------------------------------------------------------------------- results files and --out
def test_result_writer_refuses_foreign_files_and_keeps_them(tmp_path):
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=r"not a results file of this program \(list\)"):
        common.ResultWriter(str(listing), "generate", {"a": 1})
    assert listing.read_text() == "[1, 2, 3]"
    other = tmp_path / "other.json"
    other.write_text('{"results": {"tokens": [1]}}')
    with pytest.raises(ValueError, match="not a results file"):
        common.ResultWriter(str(other), "generate", {"a": 1})
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        common.ResultWriter(str(broken), "generate", {"a": 1})


def test_result_writer_resumes_same_config_refuses_another(tmp_path):
    path = tmp_path / "r.json"
    writer = common.ResultWriter(str(path), "generate", {"a": 1})
    writer.set("results", {"tokens": [[1, 2]]})
    again = common.ResultWriter(str(path), "generate", {"a": 1})
    assert again.previous["results"] == {"tokens": [[1, 2]]}
    with pytest.raises(ValueError, match=r"different config \(differs in: a\)"):
        common.ResultWriter(str(path), "generate", {"a": 2})  # no cases, but a finished run: still refused
    with pytest.raises(ValueError, match="results of 'generate'"):
        common.ResultWriter(str(path), "demo", {"a": 1})
    # an option added after the file was written: its off value resumes, any other value is refused
    assert common.ResultWriter(str(path), "generate", {"a": 1, "new_flag": False}).previous["results"]
    assert common.ResultWriter(str(path), "generate", {"a": 1, "new_opt": None}).previous["results"]
    with pytest.raises(ValueError, match=r"differs in: new_flag"):
        common.ResultWriter(str(path), "generate", {"a": 1, "new_flag": True})
    assert json.loads(path.read_text())["results"] == {"tokens": [[1, 2]]}
    assert not list(tmp_path.glob("*.tmp"))


def test_out_checked_before_any_work(tmp_path, capsys):
    assert main(["generate", "--prompt", "x", "--model", "/no/such/model", "--out", str(tmp_path)]) == 2
    assert "is a directory" in _error(capsys)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["generate", "--prompt", "x", "--out", str(blocker / "sub" / "r.json")]) == 2
    assert "cannot create its folder" in _error(capsys)
    readonly = tmp_path / "ro.json"
    readonly.write_text("")
    readonly.chmod(0o444)
    assert main(["bench-decode", "--out", str(readonly)]) == 2
    assert "read-only" in _error(capsys)
    assert main(["bench-decode", "--out", "/proc/jaxspec-results.json"]) == 2  # a folder nobody can write in
    assert "cannot write in /proc" in _error(capsys)
    nested = tmp_path / "new" / "deeper" / "r.json"
    common.check_output_path(str(nested))  # a missing parent is created
    assert nested.parent.is_dir() and not list(nested.parent.iterdir())


def test_os_error_is_one_line_not_a_traceback(tmp_path, capsys):
    assert main(["generate", "--prompt-file", str(tmp_path / "missing.txt"), "--model", "/no/such/model"]) == 2
    assert _error(capsys).startswith("error: No such file or directory")


# ---------------------------------------------------------------------------- generate options
@pytest.mark.parametrize("extra,message", [
    (["--batch", "0"], "--batch=0: must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0: must be >= 1"),
    (["--draft-skip", "mlp:1"], "--draft-skip is an option of --method sd"),
    (["--draft", "x"], "--draft is an option of --method sd"),
    (["--gamma", "3"], "--gamma is an option of --method sd"),
    (["--compare-ar"], "--method ar is autoregressive already"),
    (["--profile"], "--profile is an option of --method sd"),
    (["--budget", "128"], "--budget is an option of --method dustin"),
    (["--knapspec-interval", "8"], "--knapspec-interval is an option of --method knapspec"),
    (["--clasp-skip-count", "2"], "--clasp-skip-count is an option of --method knapspec"),
    (["--method", "sd", "--draft-skip", "mlp:1", "--fixed-tau", "0"], "--fixed-tau=0.0: must lie in [1, gamma + 1"),
    (["--method", "sd", "--draft-skip", "mlp:12-10"], "the range 12-10 is reversed"),
    (["--method", "sd", "--draft-skip", "mlp:1", "--gamma", "0"], "--gamma=0: must be >= 1"),
    (["--method", "sd", "--draft-skip", "mlp:1", "--gamma", "9", "--max-new-tokens", "8"],
     "--gamma=9 exceeds --max-new-tokens=8"),
    (["--method", "sd"], "needs exactly one of --draft SOURCE or --draft-skip SPEC"),
    (["--method", "sd", "--draft-skip", "mlp:1", "--budget", "128"], "--budget is an option of --method dustin"),
    (["--method", "knapspec", "--draft-skip", "mlp:1"], "--method knapspec does not take it"),
    (["--method", "knapspec", "--gamma", "3"], "--method knapspec does not take it"),
    (["--method", "clasp", "--clasp-skip-count", "0"], "--clasp-skip-count=0: must be >= 1"),
    (["--method", "knapspec", "--knapspec-gamma-max", "20", "--max-new-tokens", "8"],
     "--knapspec-gamma-max=20 exceeds --max-new-tokens=8"),
    (["--method", "knapspec", "--knapspec-gamma-buckets", "1,x"], "expected comma-separated integers"),
    (["--method", "knapspec", "--knapspec-weight-cap", "0"], "--knapspec-weight-cap=0: must be >= 1"),
    (["--method", "streaming", "--budget", "128", "--draft-skip", "mlp:1", "--knapspec-interval", "9"],
     "--knapspec-interval is an option of --method knapspec"),
    (["--method", "knapspec-dustin"], "--method knapspec-dustin needs --budget K"),
    (["--method", "knapspec-dustin", "--budget", "100"], "KV budget k=100 is not supported"),
    (["--method", "knapspec-dustin", "--budget", "128", "--draft-skip", "mlp:1"],
     "--method knapspec-dustin does not take it"),
    (["--method", "knapspec-dustin", "--budget", "128", "--knapspec-coupled"], "needs the sub-layer DP"),
    (["--method", "streaming", "--budget", "128", "--draft-skip", "mlp:1", "--dustin-reselect-every", "2"],
     "--dustin-reselect-every is a dustin option; --method streaming does not take it"),
    (["--method", "dustin", "--budget", "128", "--draft-skip", "mlp:1", "--dustin-reselect-every", "0"],
     "--dustin-reselect-every=0 must be >= 1"),
    (["--method", "knapspec-dustin", "--budget", "128", "--knapspec-static-plans"],
     "--knapspec-static-plans compiles KnapSpec's own draft per plan"),
    (["--method", "sd", "--draft-skip", "mlp:1", "--knapspec-static-plans"],
     "--knapspec-static-plans is an option of --method knapspec"),
    (["--method", "knapspec-dustin", "--budget", "128", "--knapspec-early-exit", "0.5"],
     "--knapspec-early-exit=0.5: --method knapspec-dustin drafts every token"),
    (["--method", "knapspec-dustin", "--budget", "128", "--arbitrate", "8"], "--arbitrate=8: --method knapspec-dustin"),
    (["--method", "knapspec-dustin", "--budget", "512", "--dustin-profile",
      "experiments/profiles/qwen2.5-coder-1.5b_qwen2.5-coder-0.5b.json"], "needs a self-draft profile"),
    (["--method", "knapspec", "--budget", "128"], "--budget is an option of --method dustin"),
    (["--method", "clasp", "--knapspec-reference-kv", "target"],
     "--knapspec-reference-kv target: --method clasp runs its own DP"),
    (["--method", "knapspec", "--knapspec-coupled", "--knapspec-reference-kv", "target"], "is for the sub-layer DP"),
    (["--method", "sd", "--draft-skip", "mlp:1", "--knapspec-reference-kv", "target"],
     "--knapspec-reference-kv is an option of --method knapspec"),
])
def test_generate_refuses_unused_or_bad_options_before_loading(capsys, extra, message):
    argv = ["generate", "--model", "/no/such/model", "--prompt", "x", *extra]
    assert main(argv) == 2
    line = _error(capsys)
    assert message in line, line


def test_generate_batch_with_a_batch_file(tmp_path, capsys):
    path = tmp_path / "b.json"
    path.write_text('["a", "b"]')
    assert main(["generate", "--model", "/no/such/model", "--batch-file", str(path), "--batch", "4"]) == 2
    assert "--batch-file already gives 2 rows" in _error(capsys)


def test_generate_default_dtype_is_float32_on_cpu():
    import argparse

    from experiments.generate import add_generate_args, check_generate_args

    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    args = parser.parse_args(["--method", "sd", "--draft-skip", "mlp:1", "--prompt", "x"])
    check_generate_args(args)
    assert args.dtype == "float32" and args.gamma == 4


@pytest.mark.slow
def test_generate_clasp_skip_count_beyond_the_layers_before_profiling(tiny, tmp_path, capsys):
    profile = tmp_path / "latency.json"
    assert main(["generate", "--model", str(tiny), "--prompt", TINY_PROMPT, "--method", "clasp",
                 "--clasp-skip-count", "3", "--max-new-tokens", "8", "--latency-profile", str(profile)]) == 2
    assert "--clasp-skip-count=3: the model has 3 layers; give 1..2" in _error(capsys)
    assert not profile.exists()  # refused before any latency profiling


@pytest.mark.slow
def test_generate_resumes_instead_of_overwriting(tiny, tmp_path, capsys):
    out = tmp_path / "g.json"
    base = ["generate", "--model", str(tiny), "--prompt", TINY_PROMPT, "--max-new-tokens", "6", "--no-warmup",
            "--no-chat", "--out", str(out)]
    assert main(base + ["--method", "sd", "--draft-skip", "mlp:1", "--gamma", "2", "--compare-ar"]) == 0
    first = capsys.readouterr()
    results = json.loads(out.read_text())["results"]
    assert results["identical_to_ar"] is True and "float32" in results["identity_note"]
    assert "output identical to autoregressive decoding" in first.out and "bfloat16" in first.out
    assert "decoding: autoregressive" in first.err and "decoding: speculative" in first.err
    stamp = out.stat().st_mtime_ns
    assert main(base + ["--method", "sd", "--draft-skip", "mlp:1", "--gamma", "2", "--compare-ar"]) == 0
    assert "[resume]" in capsys.readouterr().err and out.stat().st_mtime_ns == stamp  # nothing run, nothing written
    assert main(base + ["--method", "sd", "--draft-skip", "mlp:1", "--gamma", "3", "--compare-ar"]) == 2
    assert "different config (differs in: gamma)" in _error(capsys)
    assert json.loads(out.read_text())["results"] == results


@pytest.mark.slow
def test_generate_on_fused_projections_equals_ar(tiny, tmp_path):
    """--fused-projections (docs/methods.md §2, fused projections): the speculative run and its AR comparison both on
    the fused layout, greedy output identical in float32."""
    out = tmp_path / "fused.json"
    assert main(["generate", "--model", str(tiny), "--prompt", TINY_PROMPT, "--max-new-tokens", "8", "--no-warmup",
                 "--no-chat", "--method", "sd", "--draft-skip", "mlp:1", "--gamma", "2", "--compare-ar",
                 "--fused-projections", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["fused_projections"] is True and data["results"]["identical_to_ar"] is True


def test_generate_fused_projections_refuse_a_mesh(capsys):
    assert main(["generate", "--prompt", "x", "--fused-projections", "--mesh", "data=2"]) == 2
    assert "--fused-projections with --mesh data=2: the fused layout is for one device" in _error(capsys)


# ---------------------------------------------------------------------------- parity, benchmarks, knapspec
def test_parity_bad_input(tmp_path, capsys):
    assert main(["parity", "--model", "random:smollm2-135m-shape", "--prompt-tokens", "0"]) == 2
    assert "--prompt-tokens=0: must be >= 1" in _error(capsys)
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert main(["parity", "--model", str(folder)]) == 2
    assert "folder without tokenizer files" in _error(capsys)
    (folder / "config.json").unlink()
    assert main(["parity", "--model", str(folder)]) == 2
    assert "folder without config.json" in _error(capsys)
    assert main(["parity", "--model", "smollm2-135m", "--layers", "2"]) == 2
    assert "--layers is for random:PRESET models only" in _error(capsys)


@pytest.mark.parametrize("argv,message", [
    (["bench-decode", "--new-tokens", "0"], "--new-tokens=0: must be >= 1"),
    (["bench-decode", "--contexts", "8192,0"], "expected one or more integers >= 1"),
    (["bench-decode", "--projections", "separate,packed"],
     "--projections='separate,packed': give a comma list of distinct layouts from ['separate', 'fused']"),
    (["bench-skip", "--steps", "0"], "--steps=0: must be >= 1"),
    (["bench-plain", "--new-tokens", "4"], "--new-tokens=4: must be >= 8"),
    (["bench-plain", "--batches", "1,0"], "--batches='1,0': expected one or more integers >= 1"),
    (["bench-sd", "--tau", "2", "--gamma", "0"], "--gamma=0: must be >= 1"),
    (["bench-sd", "--tau", "2", "--draft-skip", "mlp:9-3"], "the range 9-3 is reversed"),
    (["dustin-speed", "--tau", "2", "--new-tokens", "0"], "--new-tokens=0: must be >= 1"),
    (["dustin-speed", "--tau", "2", "--batches", "0"], "--batches='0': expected one or more integers >= 1"),
    (["dustin-speed", "--tau", "2", "--fused-projections", "--mesh", "data=2"],
     "--fused-projections with --mesh data=2: the fused layout is for one device"),
    (["dustin-profile", "--draft-skip", "mlp:9-3", "--profile-file", "p.json"], "the range 9-3 is reversed"),
    (["knapspec", "--model", "random:smollm2-135m-shape", "--gamma-buckets", "1,x"], "expected comma-separated"),
    (["knapspec", "--model", "random:smollm2-135m-shape", "--gamma-max", "0"], "--gamma-max=0: must be >= 1"),
    (["knapspec", "--model", "random:smollm2-135m-shape", "--max-plan-fraction", "2"], "must be < 1"),
    (["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "2", "--clasp-skip-count", "2"],
     "--clasp-skip-count=2: the model has 2 layers"),
])
def test_benchmark_and_knapspec_flags_checked_first(capsys, argv, message):
    assert main(argv) == 2
    assert message in _error(capsys)


def test_bench_plain_times_both_loops_at_two_lengths_and_counts_copies(tmp_path):
    """bench-plain: the engine's plain stretch and the AR loop on one cache, each at a quarter of the new tokens and
    at all of them (the step is the difference over the extra steps), the compiled programs' copies counted and
    written out; a rerun resumes."""
    from experiments.decode_speed import hlo_copies

    out, hlo = tmp_path / "plain.json", tmp_path / "hlo"
    argv = ["bench-plain", "--shape", "smollm2-135m-shape", "--layers", "2", "--context", "64", "--batches", "2",
            "--new-tokens", "8", "--repeats", "2", "--attention-backend", "xla", "--hlo-dir", str(hlo), "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["cases"]["smollm2-135m-shape/ctx64/b2/n8"]
    assert [r["variant"] for r in rows] == ["ar", "plain", "plain-keep-finished", "plain-static-bound"]
    assert rows[0]["step_over_ar"] == 1
    for row in rows:
        assert (row["n1"], row["n2"]) == (2, 8) and all(len(v) == 2 for v in row["samples_s"].values())
        assert row["step_ms"] == pytest.approx((row["call_n2_ms"] - row["call_n1_ms"]) / 6)
        assert row["per_call_ms"] == pytest.approx(row["call_n1_ms"] - 2 * row["step_ms"])
        assert row["hlo"]["copies"] == hlo_copies((hlo / f"{row['variant']}_b2.hlo.txt").read_text())["copies"]
    assert main(argv) == 0 and json.loads(out.read_text())["cases"]["smollm2-135m-shape/ctx64/b2/n8"] == rows
    text = ("%body (p: (s32[], bf16[4,1024,64])) -> (s32[], bf16[4,1024,64]) {\n"
            "  %copy.1 = bf16[4,1024,64]{2,1,0} copy(%gte)\n  %copy.2 = s32[] copy(%x)\n}\n"
            "ENTRY %main (a: f32[2]) -> f32[2] {\n  %copy.3 = f32[2]{0} copy(%a)\n}\n")
    found = hlo_copies(text, min_bytes=1 << 19)
    assert found["copies"] == 3 and found["large"] == [{"shape": "bf16[4,1024,64]", "bytes": 524288, "in": "body"}]


def test_bench_decode_times_both_projection_layouts_in_one_run(tmp_path):
    """bench-decode --projections separate,fused: both layouts on one cache fill, timed alternately; the fused
    rows carry their step time over the separate one's and three fewer matrix products per layer; a rerun
    resumes."""
    from experiments.decode_speed import matrix_products

    out = tmp_path / "decode.json"
    argv = ["bench-decode", "--shape", "smollm2-135m-shape", "--layers", "2", "--contexts", "64", "--batches", "2",
            "--new-tokens", "4", "--repeats", "2", "--copy-gib", "0.01", "--dtype", "float32",
            "--projections", "separate,fused", "--out", str(out)]
    assert main(argv) == 0
    cases = json.loads(out.read_text())["cases"]
    key = "smollm2-135m-shape/ctx64/b2"
    separate, fused = cases[key]["row"], cases[key + "/fused"]["row"]
    assert (separate["projections"], fused["projections"]) == ("separate", "fused")
    assert separate["matrix_products"] - fused["matrix_products"] == 3 * 2
    assert fused["step_vs_separate"] == pytest.approx(
        cases["smollm2-135m-shape/ctx64/b2/fused"]["timing"]["median_s"]
        / cases["smollm2-135m-shape/ctx64/b2"]["timing"]["median_s"])
    assert len(cases["smollm2-135m-shape/ctx64/b2/fused"]["timing"]["all_s"]) == 2
    assert main(argv) == 0 and json.loads(out.read_text())["cases"] == cases
    assert matrix_products('%d = f32[2] dot(%a, %b)\n%c = custom-call(), custom_call_target="__cublas$gemm"') == 2
    # one layer's products listed by result shape and op: q, k, v as three products, then as one [B, Hq*D + 2*Hkv*D]
    listed = {layout: cases[key + suffix]["layer_products"] for layout, suffix in (("separate", ""), ("fused", "/fused"))}
    assert len(listed["separate"]) - len(listed["fused"]) == 3, listed
    assert sum("btd,dq->btq" in p for p in listed["separate"]) == 1
    assert sum("btd,dn->btn" in p for p in listed["fused"]) == 1 and not any("dq->btq" in p for p in listed["fused"])


# ---------------------------------------------------------------------------- suite runner
def _suite(folder, name, text):
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.toml").write_text(text)


FAST_OK = 'run = "bench-skip --shape smollm2-135m-shape --layers 1 --context 8 --batch 1 --repeats 1"'


def test_suite_validation_names_file_step_and_field(tmp_path, capsys):
    d = tmp_path / "suites"
    cases = {
        "nodesc": ('device = "cpu"\n[[steps]]\nname = "a"\n' + FAST_OK, "missing field 'description'"),
        "badtype": ('description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\n' + FAST_OK + "\ntimeout_s = \"5\"",
                    "step 'a': field 'timeout_s' must be an integer or a number"),
        "extra": ('description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\n' + FAST_OK + "\ntimeout = 3",
                  "step 'a': unknown field(s) ['timeout']"),
        "dup": ('description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\n' + FAST_OK
                + '\n[[steps]]\nname = "a"\n' + FAST_OK, "step 'a': field 'name' repeats 'a'"),
        "badrun": ('description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\nrun = "no-such-experiment --x"',
                   "step 'a': field 'run' is not a valid experiment command"),
        "badflag": ('description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\nrun = "bench-skip --nope 3"',
                    "unrecognized arguments: --nope 3"),
        "norun": ('description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"', "step 'a': missing field 'run'"),
        "notoml": ('description = "d', "not valid TOML"),
        "badenv": ('description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\n' + FAST_OK + "\nenv = {X = 3}",
                   "step 'a': field 'env' must map variable names to strings; bad entries ['X']"),
        "badsuiteenv": ('description = "d"\ndevice = "cpu"\nenv = {Y = 1}\n[[steps]]\nname = "a"\n' + FAST_OK,
                        "field 'env' must map variable names to strings; bad entries ['Y']"),
    }
    for name, (text, _) in cases.items():
        _suite(d, name, text)
    for name, (_, message) in cases.items():
        assert main(["suite", name, "--suites-dir", str(d), "--dry-run"]) == 2
        line = _error(capsys)
        assert message in line and f"{name}.toml" in line, (name, line)
    assert main(["suite", "missing", "--suites-dir", str(d)]) == 2
    assert "no suite 'missing'" in _error(capsys)


def test_suite_list_dry_run_and_steps(tmp_path, capsys, monkeypatch):
    d = tmp_path / "suites"
    _suite(d, "tiny", 'description = "A tiny CPU suite."\ndevice = "cpu"\nneeds = []\n'
                      f'[[steps]]\nname = "one"\n{FAST_OK}\n[[steps]]\nname = "two"\n{FAST_OK}\ntimeout_s = 60\n')
    monkeypatch.setenv("JAXSPEC_SUITES_DIR", str(d))
    assert main(["suite", "--list"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "A tiny CPU suite." in out
    assert main(["suite", "tiny", "--dry-run", "--steps", "two"]) == 0
    out = capsys.readouterr().out
    assert "python -m experiments.run bench-skip" in out and "two" in out and "one " not in out
    assert main(["suite", "tiny", "--steps", "three"]) == 2
    assert "unknown step(s) ['three']" in _error(capsys)
    assert main(["suite", "tiny", "--time-budget", "0"]) == 2
    assert "--time-budget=0.0: must be > 0" in _error(capsys)


def test_suite_steps_say_whether_their_result_file_exists(tmp_path, capsys, monkeypatch):
    """--dry-run names, per step, whether its --out file exists (measured) or not (not yet); '-' without --out."""
    assert Step("a", "tables --out experiments/results/index.json").measured() == "yes"
    assert Step("b", "bench-skip --out=experiments/results/none/never_cpu.json").out() == \
        "experiments/results/none/never_cpu.json"
    assert Step("b", "bench-skip --out=experiments/results/none/never_cpu.json").measured() == "not yet"
    assert Step("c", "bench-skip --steps 2").measured() == "-"
    d = tmp_path / "suites"
    _suite(d, "tiny", 'description = "A tiny CPU suite."\ndevice = "cpu"\nneeds = []\n'
                      f'[[steps]]\nname = "one"\n{FAST_OK}\n')
    monkeypatch.setenv("JAXSPEC_SUITES_DIR", str(d))
    assert main(["suite", "tiny", "--dry-run"]) == 0
    assert "result file" in capsys.readouterr().out


def test_suite_step_env_reaches_the_step_process_only(tmp_path, monkeypatch):
    from experiments import suite

    d = tmp_path / "suites"
    _suite(d, "env", 'description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\n' + FAST_OK
           + '\nenv = {XLA_FLAGS = "--xla_dump_to=/tmp/x", JAXSPEC_TEST_MARK = "1"}\n')
    (step,) = suite.load_suite(d / "env.toml").steps
    seen = {}

    class FakeProcess:
        pid = 0

        def __init__(self, command, cwd, start_new_session, env):
            seen.update(command=command, env=env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(suite.subprocess, "Popen", FakeProcess)
    monkeypatch.delenv("JAXSPEC_TEST_MARK", raising=False)
    assert suite.run_step(step, timeout=5)["status"] == "ok"
    assert seen["env"]["XLA_FLAGS"] == "--xla_dump_to=/tmp/x" and seen["env"]["JAXSPEC_TEST_MARK"] == "1"
    assert seen["command"][-8:] == step.argv()[-8:]
    assert "JAXSPEC_TEST_MARK" not in __import__("os").environ


def test_suite_env_reaches_every_step_and_a_step_env_wins(tmp_path):
    from experiments import suite

    d = tmp_path / "suites"
    _suite(d, "env", 'description = "d"\ndevice = "cpu"\nenv = {A = "suite", B = "suite"}\n'
           f'[[steps]]\nname = "one"\n{FAST_OK}\nenv = {{B = "step"}}\n[[steps]]\nname = "two"\n{FAST_OK}\n')
    one, two = suite.load_suite(d / "env.toml").steps
    assert dict(one.env) == {"A": "suite", "B": "step"}
    assert dict(two.env) == {"A": "suite", "B": "suite"}


@pytest.mark.slow
def test_suite_runs_steps_reports_and_fails(tmp_path, capsys):
    d = tmp_path / "suites"
    ok_out = tmp_path / "skip.json"
    _suite(d, "mixed", 'description = "ok, failing, timed out"\ndevice = "cpu"\n'
                       f'[[steps]]\nname = "ok"\n{FAST_OK[:-1]} --out {ok_out}"\ntimeout_s = 300\n'
                       '[[steps]]\nname = "bad"\nrun = "bench-decode --new-tokens 0"\n'
                       '[[steps]]\nname = "slow"\nrun = "bench-decode --shape smollm2-135m-shape"\ntimeout_s = 1\n')
    summary = tmp_path / "summary.json"
    assert main(["suite", "mixed", "--suites-dir", str(d), "--out", str(summary)]) == 2
    captured = capsys.readouterr()
    assert "step(s) not ok: bad, slow" in captured.err.strip().splitlines()[-1]
    cases = json.loads(summary.read_text())["cases"]
    assert {k: v["status"] for k, v in cases.items()} == {"ok": "ok", "bad": "failed", "slow": "timed out"}
    assert cases["bad"]["rc"] == 2 and ok_out.exists()
    assert "suite mixed: 1/3 step(s) ok" in captured.out
    # a budget smaller than what is left: the steps after it are not started
    assert main(["suite", "mixed", "--suites-dir", str(d), "--steps", "bad,slow", "--time-budget", "0.001"]) == 2
    assert "not run (time budget)" in capsys.readouterr().out


def _children(pid):
    """Pids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid):
    try:
        state = (pathlib.Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_terminated_suite_takes_its_running_step_down(tmp_path):
    """SIGTERM to the runner (what ``timeout`` sends) kills the step's whole process group: a step
    must not keep running (and sharing the device) after its suite was stopped."""
    import signal
    import subprocess
    import sys
    import time

    d = tmp_path / "suites"
    _suite(d, "long", 'description = "one long step"\ndevice = "cpu"\n[[steps]]\nname = "long"\n'
                      'run = "bench-decode --shape smollm2-135m-shape --contexts 4096 --batches 8 --new-tokens 4096"\n')
    runner = subprocess.Popen([sys.executable, "-m", "experiments.run", "suite", "long", "--suites-dir", str(d)],
                              cwd=pathlib.Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        children = []
        while not children and time.time() < deadline and runner.poll() is None:
            time.sleep(0.2)
            children = _children(runner.pid)
        assert children, "the suite never started its step"
        time.sleep(1.0)
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) != 0
        deadline = time.time() + 30
        while any(_alive(c) for c in children) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(c) for c in children), "the step outlived its terminated suite"
    finally:
        if runner.poll() is None:
            runner.kill()


# ---------------------------------------------------------------------------- demo and the compilation cache
def test_compilation_cache_on_by_default_and_opt_out(tmp_path, monkeypatch):
    import jax

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv(common.NO_COMPILATION_CACHE_ENV, "1")
        assert common.enable_compilation_cache() is None
        monkeypatch.delenv(common.NO_COMPILATION_CACHE_ENV)
        assert common.enable_compilation_cache(False) is None
        path = common.enable_compilation_cache()
        assert path == tmp_path / "jax_compilation_cache" and path.is_dir()
        assert jax.config.jax_compilation_cache_dir == str(path)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_compilation_cache_folder_and_emptying(tmp_path, monkeypatch):
    import jax

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "home"))
    monkeypatch.delenv(common.NO_COMPILATION_CACHE_ENV, raising=False)
    before = jax.config.jax_compilation_cache_dir
    own = tmp_path / "own"
    own.mkdir()
    (own / "jit_f-abc-cache").write_bytes(b"x")
    (own / "jit_f-abc-atime").write_bytes(b"y")
    try:
        with pytest.raises(ValueError, match="needs --compilation-cache DIR"):
            common.enable_compilation_cache(True, None, empty=True)
        with pytest.raises(ValueError, match="cache is off"):
            common.enable_compilation_cache(False, str(own), empty=True)
        assert sorted(p.name for p in own.iterdir()) == ["jit_f-abc-atime", "jit_f-abc-cache"]  # nothing lost
        path = common.enable_compilation_cache(True, str(own))
        assert path == own and len(list(own.iterdir())) == 2
        assert jax.config.jax_compilation_cache_dir == str(own)
        assert common.enable_compilation_cache(True, str(own), empty=True) == own and not list(own.iterdir())
        (own / "a-folder").mkdir()
        (own / "jit_g-cache").write_bytes(b"z")
        with pytest.raises(ValueError, match="refuses .*'a-folder'"):
            common.enable_compilation_cache(True, str(own), empty=True)
        assert (own / "jit_g-cache").exists()  # refused before deleting anything
        assert common.enable_compilation_cache(True, str(tmp_path / "new"), empty=True) == tmp_path / "new"
        assert common.enable_compilation_cache() == tmp_path / "home" / "jax_compilation_cache"  # default again
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_warm_workers_never_empty_the_cache(tmp_path, monkeypatch):
    seen = []

    class Done:
        def __init__(self, command, **kw):
            seen.append(command)

        def wait(self):
            return 0

    monkeypatch.setattr(common.subprocess, "Popen", Done)
    common.warm_compilation_cache("demo", ["--compilation-cache", "/x", "--empty-compilation-cache", "--gamma", "2"],
                                  [{"--gamma": "3"}])
    assert seen and "--empty-compilation-cache" not in seen[0] and seen[0][-4:] == ["--compilation-cache", "/x",
                                                                                     "--gamma", "3"]


def test_demo_method_choices(capsys):
    assert "prompt-lookup" in registry.method_names()
    assert main(["demo", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens=0" in _error(capsys)


def test_demo_gamma_default_override_and_refusals(capsys):
    """The demo's draft length: each method's own unless --gamma says otherwise; refused (before any model
    loads) where the method chooses it itself or where it is out of range."""
    from experiments.generate import DEMO_METHODS, demo_args

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    generate.register(sub)

    def resolved(*argv):
        return demo_args(parser.parse_args(["demo", *argv]))

    assert resolved().gamma == DEMO_METHODS["prompt-lookup"]["gamma"] == 1
    assert resolved("--demo-method", "self-draft").gamma == 4
    assert resolved("--gamma", "3").gamma == 3 and resolved("--gamma", "3").method == "prompt-lookup"
    with pytest.raises(ValueError, match=r"--gamma=2: the knapspec demo chooses its draft length itself"):
        resolved("--demo-method", "knapspec", "--gamma", "2")
    assert main(["demo", "--gamma", "0"]) == 2
    assert "--gamma=0: must be >= 1" in _error(capsys)
    assert main(["demo", "--gamma", "9", "--max-new-tokens", "4"]) == 2
    assert "--gamma=9 exceeds --max-new-tokens=4" in _error(capsys)


@pytest.mark.slow
def test_demo_side_by_side_on_a_tiny_model(tiny, tmp_path, capsys, monkeypatch):
    from experiments import generate

    monkeypatch.setitem(generate.DEMO_METHODS, "self-draft", {"method": "sd", "draft_skip": "mlp:1", "gamma": 2})
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(TINY_PROMPT)
    out = tmp_path / "demo.json"
    assert main(["demo", "--model", str(tiny), "--prompt-file", str(prompt), "--max-new-tokens", "8",
                 "--demo-method", "self-draft", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    for phase in ("loading", "compiling and running the prefill", "prefill: first token after",
                  "decoding: autoregressive", "decoding: speculative"):
        assert phase in captured.err, phase
    assert "pays on this machine" in captured.out or "does NOT pay on this machine" in captured.out
    results = json.loads(out.read_text())["results"]
    demo = results["demo"]
    assert demo["time_to_first_token_s"] > 0 and demo["demo_method"] == "self-draft"
    assert results["identical_to_ar"] is True and results["speedup_vs_ar"] > 0
    assert set(demo["compiles"]) == {"cache_hits", "cache_misses"}


@pytest.mark.slow
def test_generate_prompt_lookup_equals_ar_on_a_tiny_model(tiny, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(TINY_PROMPT * 3)  # repeated text: the n-gram lookup finds its continuation
    out = tmp_path / "lookup.json"
    assert main(["generate", "--model", str(tiny), "--prompt-file", str(prompt), "--max-new-tokens", "12",
                 "--method", "prompt-lookup", "--gamma", "3", "--ngram-max", "2", "--compare-ar", "--no-chat",
                 "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["identical_to_ar"] is True
    assert results["draft"] == {"prompt_lookup": {"max_ngram": 2, "min_ngram": 1, "short_verify": True}}
    assert main(["generate", "--model", str(tiny), "--method", "prompt-lookup", "--ngram-min", "3",
                 "--ngram-max", "2", "--prompt", "x"]) == 2
    assert "--ngram-min=3" in _error(capsys)
    assert main(["generate", "--model", str(tiny), "--method", "ar", "--ngram-max", "4", "--prompt", "x"]) == 2
    assert "--ngram-max is an option of --method prompt-lookup" in _error(capsys)


# ---------------------------------------------------------------------------- imports
def _imports(path: pathlib.Path):
    """(module imported, names) of every import statement in ``path``, function-level ones included."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def test_experiment_modules_import_one_way_and_nothing_private():
    # an experiment module is experiments/NAME.py or a package experiments/NAME/ (every file of it, one node)
    modules = {p.stem: [p] for p in (REPO / "experiments").glob("*.py") if p.stem != "__init__"}
    modules.update({p.parent.name: sorted(p.parent.rglob("*.py"))
                    for p in (REPO / "experiments").glob("*/__init__.py")})
    graph = {}
    for name, paths in modules.items():
        deps = set()
        for path in paths:
            for module, names in _imports(path):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                assert not private, f"{path.relative_to(REPO)} imports private {private} from {module}"
                if module == "experiments":
                    deps.update(n for n in names if n in modules)
                elif module.startswith("experiments."):
                    deps.add(module.split(".")[1])
        graph[name] = deps - {name}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph.get(node, ()):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(stack + [node, dep])}"
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])
    assert "registry" in graph and not graph["registry"], "experiments/registry.py imports no experiment module"
    assert set(registry.EXPERIMENT_MODULES) <= {f"experiments.{m}" for m in modules}


def test_every_method_registered_once_with_its_family():
    names = registry.method_names()
    assert names[:2] == ["ar", "sd"] and len(names) == len(set(names))
    assert {"knapspec", "clasp", "static-skip", "dustin", "streaming", "snapkv", "quest", "magicdec"} <= set(names)
    assert set(registry.METHOD_ARGUMENTS) == {m.family for m in registry.METHODS.values()}


def test_bench_selection_times_every_rule_against_the_fixed_rule(tmp_path):
    """bench-selection: one case per (context, batch, k), each rule's time beside the fixed rule's on the same
    signals, the coverage rule's set checked against its direct reference."""
    out = tmp_path / "sel.json"
    assert main(["bench-selection", "--contexts", "1024", "--batches", "2", "--budgets", "128", "--iters", "1",
                 "--repeats", "1", "--dustin-profile", str(pathlib.Path(__file__).resolve().parents[2] / "experiments"
                                                           / "profiles" / "qwen2.5-coder-1.5b_qwen2.5-coder-0.5b.json"),
                 "--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["ctx1024/b2/k128"]
    assert set(case["ratio_to_fixed"]) == {"coverage", "entropy", "max-mass"}
    assert case["m"] == 73 and case["coverage_equals_reference"] is True
    assert all(t > 0 for t in case["seconds"].values())
    # the coverage rule's wider candidate ladder, also checked against its reference
    ladder = tmp_path / "ladder.json"
    assert main(["bench-selection", "--contexts", "1024", "--batches", "2", "--budgets", "128", "--iters", "1",
                 "--repeats", "1", "--rules", "coverage-ladder", "--m-steps", "3", "--out", str(ladder)]) == 0
    case = json.loads(ladder.read_text())["cases"]["ctx1024/b2/k128"]
    assert set(case["ratio_to_fixed"]) == {"coverage-ladder"} and case["coverage_ladder_equals_reference"] is True
    # the fixed rule with a per-row m, and the coverage rule deciding every third round: per round, one decision and
    # two per-row selections with the m it chose, which on the same signals select the rule's own set; scheduled from
    # the host, as the verifier's one round body runs it (select_held, the decision a traced predicate) and as the
    # unrolled loop runs it (one program, each round's kind compiled in)
    held = tmp_path / "held.json"
    assert main(["bench-selection", "--contexts", "1024", "--batches", "2", "--budgets", "128", "--iters", "1",
                 "--repeats", "1", "--rules",
                 "fixed-rows,coverage-held3,coverage-held3-cond,coverage-held3-unrolled,fixed-cycle3",
                 "--out", str(held)]) == 0
    case = json.loads(held.read_text())["cases"]["ctx1024/b2/k128"]
    assert set(case["ratio_to_fixed"]) == {"fixed-rows", "coverage-held3", "coverage-held3-cond",
                                           "coverage-held3-unrolled", "fixed-cycle3"}
    assert all(case[f"coverage_held3{tail}_equals_reference"] is True for tail in ("", "_cond"))
    assert case["coverage_held3_unrolled_equals_host"] is True  # its rounds on their own signals
    assert case["ratio_to_fixed_cycle"]["coverage-held3-unrolled"] == pytest.approx(
        case["seconds"]["coverage-held3-unrolled"] / case["seconds"]["fixed-cycle3"])


def test_bench_scoring_times_each_profiles_srhs_on_the_same_keys(tmp_path, capsys):
    """bench-scoring: one round's s_T + s_D with each profile's own layers and heads, the key bytes each reads
    (GQA-aware SRHs read one KV group per SRH layer), ratios against the first profile."""
    profiles = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "profiles"
    anywhere = str(profiles / "qwen2.5-coder-1.5b_qwen2.5-coder-0.5b.json")
    one_group = str(profiles / "qwen2.5-coder-1.5b_qwen2.5-coder-0.5b_srh-1group.json")
    out = tmp_path / "scoring.json"
    assert main(["bench-scoring", "--dustin-profile", f"{anywhere},{one_group}", "--contexts", "512", "--batches", "2",
                 "--budgets", "128", "--iters", "1", "--repeats", "1", "--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["ctx512/b2/k128"]
    info = case["profiles"]
    assert info[anywhere]["target_kv_groups"] == 2 and info[one_group]["target_kv_groups"] == 1
    assert all(g == 1 for g in info[one_group]["draft_kv_groups"])
    # key bytes: batch x positions x 4 bytes x (target groups x 128 + draft groups x 64)
    for name in (anywhere, one_group):
        i = info[name]
        assert i["key_bytes"] == 2 * 512 * 4 * (i["target_kv_groups"] * 128 + sum(i["draft_kv_groups"]) * 64)
    assert all(t > 0 for t in case["seconds"].values()) and case["rows"][0]["vs_first"] == 1.0
    assert main(["bench-scoring", "--dustin-profile", f"{anywhere},{anywhere}"]) == 2
    assert "distinct profiles" in capsys.readouterr().err
    assert main(["bench-scoring", "--dustin-profile", one_group, "--budgets", "2048"]) == 2
    assert "has no config for k=[2048]" in capsys.readouterr().err
    # each profile with each scoring layout, the same scores every way (the Pallas kernel interpreted here)
    layouts = tmp_path / "layouts.json"
    assert main(["bench-scoring", "--dustin-profile", one_group, "--contexts", "256", "--batches", "1", "--budgets",
                 "128", "--iters", "1", "--repeats", "1", "--scoring-layouts", "groups,pallas", "--out",
                 str(layouts)]) == 0
    case = json.loads(layouts.read_text())["cases"]["ctx256/b1/k128"]
    assert [(r["profile"], r["layout"]) for r in case["rows"]] == [(one_group, "groups"), (one_group, "pallas")]
    pallas = case["profiles"][f"{one_group} [pallas]"]
    assert pallas["layout"] == "pallas" and pallas["rel_diff_vs_first"] < 1e-5
    assert main(["bench-scoring", "--dustin-profile", one_group, "--scoring-layouts", "groups,tiles"]) == 2
    assert "--scoring-layouts 'groups,tiles'" in capsys.readouterr().err


def test_bench_selection_refuses_an_unknown_rule(capsys):
    assert main(["bench-selection", "--rules", "coverage,median"]) == 2
    assert "median" in capsys.readouterr().err
    assert main(["bench-selection", "--rules", "coverage-ladder", "--m-steps", "1"]) == 2
    assert "--m-steps=1: the coverage-ladder rule needs a ladder of at least 2 steps" in capsys.readouterr().err


def test_an_nvidia_suite_refuses_another_gpu_model_before_any_step(tmp_path, monkeypatch, capsys):
    """A suite's result files are named after its device: on another GPU model it stops with one line naming both
    before a step runs; --any-device runs it; no nvidia-smi only warns; a CPU suite is never checked."""
    from experiments import suite

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "suites"
    _suite(d, "gpu", f'description = "d"\ndevice = "nvidia-h200"\n[[steps]]\nname = "a"\n{FAST_OK}\n')
    _suite(d, "one", f'description = "d"\ndevice = "nvidia-h100-x1"\n[[steps]]\nname = "a"\n{FAST_OK}\n')
    _suite(d, "cpu", f'description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\n{FAST_OK}\n')
    ran = []
    monkeypatch.setattr(suite, "run_step", lambda step, timeout: ran.append(step.name) or {
        "step": step.name, "status": "ok", "rc": 0, "seconds": 0.0, "timeout_s": timeout, "run": step.run})
    monkeypatch.setattr(suite, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    assert main(["suite", "gpu", "--suites-dir", str(d)]) != 0
    err = capsys.readouterr().err
    assert "suite gpu is measured on nvidia-h200" in err and "this machine has NVIDIA H100 80GB HBM3" in err
    assert "--any-device" in err and ran == []
    assert main(["suite", "one", "--suites-dir", str(d)]) == 0 and ran == ["a"]  # the H100 suite runs on it
    assert main(["suite", "gpu", "--suites-dir", str(d), "--any-device"]) == 0 and ran == ["a", "a"]
    assert main(["suite", "cpu", "--suites-dir", str(d)]) == 0 and len(ran) == 3
    monkeypatch.setattr(suite, "gpu_names", lambda: [])
    assert main(["suite", "gpu", "--suites-dir", str(d)]) != 0
    assert "this machine has no NVIDIA GPU" in capsys.readouterr().err and len(ran) == 3
    monkeypatch.setattr(suite, "gpu_names", lambda: None)
    assert main(["suite", "gpu", "--suites-dir", str(d)]) == 0 and len(ran) == 4
    assert "nvidia-smi cannot say which GPU" in capsys.readouterr().err
    monkeypatch.setattr(suite, "gpu_names", lambda: ["NVIDIA H200"])
    assert main(["suite", "gpu", "--suites-dir", str(d)]) == 0 and len(ran) == 5


def test_gpu_suite_steps_wait_for_the_device_lock_and_cpu_suites_do_not(tmp_path, monkeypatch, capsys):
    """Two suite runners on one GPU: a step starts only once the other runner's step has released the device
    lock (the wait is announced with the holder); a CPU suite never takes the lock; --no-device-lock skips it."""
    import fcntl
    import threading
    import time

    from experiments import suite

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    d = tmp_path / "suites"
    _suite(d, "gpu", f'description = "d"\ndevice = "nvidia-h200"\n[[steps]]\nname = "a"\n{FAST_OK}\n')
    _suite(d, "cpu", f'description = "d"\ndevice = "cpu"\n[[steps]]\nname = "a"\n{FAST_OK}\n')
    started, notes = [], []

    def fake_step(step, timeout):  # the step's process starts here
        started.append(time.perf_counter())
        notes.append(suite.device_lock_path().read_text() if suite.device_lock_path().exists() else None)
        return {"step": step.name, "status": "ok", "rc": 0, "seconds": 0.0, "timeout_s": timeout, "run": step.run}

    monkeypatch.setattr(suite, "run_step", fake_step)
    monkeypatch.setattr(suite, "gpu_names", lambda: ["NVIDIA H200"])
    path = suite.device_lock_path()
    assert path == tmp_path / "cache" / "locks" / "device-0.lock"
    path.parent.mkdir(parents=True)
    held = open(path, "a+")
    fcntl.flock(held, fcntl.LOCK_EX)
    held.write("pid 4242")
    held.flush()
    released = []

    def release():
        time.sleep(1.0)
        released.append(time.perf_counter())
        fcntl.flock(held, fcntl.LOCK_UN)

    assert main(["suite", "cpu", "--suites-dir", str(d)]) == 0  # no lock for a CPU suite
    assert len(started) == 1
    threading.Thread(target=release).start()
    assert main(["suite", "gpu", "--suites-dir", str(d)]) == 0
    assert len(started) == 2 and started[1] >= released[0]
    assert notes[1] == f"pid {__import__('os').getpid()}, suite gpu step a"  # who holds it, while the step runs
    err = capsys.readouterr().err
    assert "waiting for the device lock" in err and "(held by pid 4242)" in err
    assert path.read_text() == ""  # the holder's note is cleared when the step releases the lock
    fcntl.flock(held, fcntl.LOCK_EX)  # held again: --no-device-lock runs at once
    assert main(["suite", "gpu", "--suites-dir", str(d), "--no-device-lock"]) == 0
    assert len(started) == 3
    fcntl.flock(held, fcntl.LOCK_UN)
    held.close()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert suite.device_lock_path().name == "device-1-2.lock"


def test_git_commit_counts_source_changes_not_results(tmp_path, monkeypatch):
    """A result file rewritten by an earlier suite step leaves the tree clean; a changed source file does not."""
    import subprocess

    from experiments import common

    repo = tmp_path / "repo"
    (repo / "experiments" / "results").mkdir(parents=True)
    run = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    (repo / "experiments" / "results" / "r.json").write_text("{}\n")
    run("add", ".")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(common, "REPO", repo)
    assert common.git_commit()["dirty"] is False
    (repo / "experiments" / "results" / "r.json").write_text('{"a": 1}\n')
    assert common.git_commit()["dirty"] is False
    (repo / "code.py").write_text("x = 2\n")
    assert common.git_commit()["dirty"] is True
