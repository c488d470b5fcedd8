"""``generate --method dustin | streaming | snapkv | quest | magicdec``, ``dustin-profile`` and
``dustin-quality`` on tiny random models (CPU, seconds): the CLI paths, their JSON and their errors."""

import json
import pathlib

import numpy as np
import pytest

from tests.conftest import tiny_llama_folder

from experiments import tables
from experiments.run import main

SMOL_PROFILE = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "profiles"
                   / "smollm2-135m_selfdraft_mlp10-12.json")
PROMPT = "Once upon a time, in a land far away, there lived a curious fox who loved long stories. " * 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dustin_cli")
    return tiny_llama_folder(root, 0, "target"), tiny_llama_folder(root, 1, "draft")


def _base(folder, *extra):
    return ["generate", "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "12", "--dtype", "float32",
            "--no-warmup", "--no-chat", "--gamma", "3", *extra]


def _results(path):
    return json.loads(path.read_text())["results"]


@pytest.mark.slow
def test_generate_sparse_methods(folders, tmp_path):
    """Every sparse method runs through `generate`; with k >= the context each equals dense ClassicSD,
    with k = 128 < context (~360 tokens) the run is sparse and labelled."""
    target, draft = folders
    dense = tmp_path / "sd.json"
    assert main(_base(target, "--method", "sd", "--draft", str(draft), "--out", str(dense))) == 0
    dense_tokens = _results(dense)["tokens"]
    for run, (method, draft_args) in enumerate((("dustin", ["--draft", str(draft)]),
                                                ("dustin", ["--draft-skip", "mlp:1"]),
                                                ("streaming", ["--draft", str(draft)]),
                                                ("snapkv", ["--draft", str(draft)]),
                                                ("quest", ["--draft", str(draft)]),
                                                ("magicdec", ["--draft", str(draft)]), ("magicdec", []))):
        big = tmp_path / f"{method}-{run}-big.json"  # one file per run: an --out of other options is refused
        assert main(_base(target, "--method", method, "--budget", "2048", "--out", str(big), *draft_args)) == 0
        results = _results(big)
        assert results["sparse"]["budget"] == 2048 and results["method"] == method
        if draft_args and draft_args[0] == "--draft" or method == "magicdec":
            # k covers the ~360-token history: exactly dense verification (MagicDec: dense by construction)
            assert results["tokens"] == dense_tokens, (method, draft_args)
        small = tmp_path / f"{method}-{run}-small.json"
        assert main(_base(target, "--method", method, "--budget", "128", "--out", str(small), *draft_args)) == 0
        results = _results(small)
        assert len(results["tokens"][0]) == 12 and results["metrics"]["tau"] >= 1
    modes = {}
    for mode in ("hybrid", "target", "draft"):
        path = tmp_path / f"dustin-{mode}.json"
        assert main(_base(target, "--method", "dustin", "--budget", "128", "--dustin-mode", mode, "--draft",
                          str(draft), "--out", str(path))) == 0
        sparse = _results(path)["sparse"]
        modes[mode] = sparse["m"]
        assert sparse["profile"] is None and "unprofiled" in sparse["note"]
    assert modes == {"hybrid": (128 - 4 - 32) // 2, "target": 0, "draft": 128 - 4 - 32}


@pytest.mark.parametrize("extra,message", [
    (["--method", "dustin", "--budget", "300"], "k=300 is not supported"),
    (["--method", "dustin", "--budget", "64"], "one of 128, 256, 512, 1024, 2048"),
    (["--method", "streaming"], "needs --budget K"),
    (["--method", "dustin", "--budget", "128"], "needs a draft"),
    (["--method", "dustin", "--budget", "128", "--draft-skip", "mlp:1", "--dustin-profile", "/no/such/file.json"],
     "does not exist"),
    (["--method", "quest", "--budget", "128", "--draft-skip", "mlp:1", "--dustin-profile", "x.json"],
     "--dustin-profile is a dustin option"),
    # the committed SmolLM2 profile: not profiled at k = 2048, and made for another model than the tiny one
    (["--method", "dustin", "--budget", "2048", "--draft-skip", "mlp:1", "--dustin-profile", SMOL_PROFILE],
     "no config for k=2048; profiled budgets: [128, 256, 512, 1024]"),
    (["--method", "dustin", "--budget", "128", "--draft-skip", "mlp:1", "--dustin-profile", SMOL_PROFILE],
     "is for another model"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--dustin-profile", SMOL_PROFILE],
     "profiles a self-draft"),
    (["--method", "streaming", "--budget", "128", "--draft", "x", "--draft-kv", "streaming"],
     "--draft-kv is a dustin option"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--draft-window", "8"],
     "needs --draft-kv streaming or verify-set"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--draft-kv", "verify-set", "--draft-window", "0"],
     "--draft-window=0 must be >= 1"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--arbitrate", "0"], "--arbitrate=0 must be >= 1"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--arbitrate-table", "t.json"],
     "give --arbitrate ROUNDS too"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--arbitrate", "2", "--arbitrate-table",
      "/no/such/table.json"], "--arbitrate-table /no/such/table.json: no such file"),
    (["--method", "dustin", "--budget", "128", "--draft-skip", "mlp:1", "--dustin-mode", "target", "--dustin-m-rule",
      "max-mass"], "needs --method dustin with --dustin-mode hybrid"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--dustin-m-steps", "3"],
     "--dustin-m-steps=3: an integer >= 1 that widens --dustin-m-rule coverage's candidates (got --dustin-m-rule fixed)"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--dustin-m-rule", "coverage", "--dustin-m-steps", "0"],
     "--dustin-m-steps=0"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--dustin-m-every", "3"],
     "--dustin-m-every=3: an integer >= 1 that holds --dustin-m-rule coverage's m between its decisions (got "
     "--dustin-m-rule fixed)"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--dustin-m-rule", "coverage", "--dustin-m-every", "0"],
     "--dustin-m-every=0"),
    (["--method", "dustin", "--budget", "128", "--draft", "x", "--dustin-m-rule", "coverage",
      "--dustin-m-every-schedule", "unrolled"],
     "--dustin-m-every-schedule=unrolled sets how the rounds of --dustin-m-every N run: give --dustin-m-every N >= 2"),
])
def test_generate_bad_input(folders, capsys, extra, message):
    target, _ = folders
    assert main(_base(target, *extra)) == 2
    assert message in capsys.readouterr().err


def test_generate_sparse_draft_kv_and_arbitrate(folders, tmp_path):
    """--draft-kv verify-set with k >= the context equals dense ClassicSD; --arbitrate records its probe."""
    target, draft = folders
    dense = tmp_path / "sd.json"
    assert main(_base(target, "--method", "sd", "--draft", str(draft), "--out", str(dense))) == 0
    path = tmp_path / "verify-set.json"
    assert main(_base(target, "--method", "dustin", "--budget", "2048", "--draft", str(draft), "--draft-kv",
                      "verify-set", "--arbitrate", "2", "--out", str(path))) == 0
    results = _results(path)
    assert results["tokens"] == _results(dense)["tokens"]
    assert results["sparse"]["draft_kv"].startswith("verify-set") and results["sparse"]["dustin"]["draft_kv"] == \
        "verify-set"
    assert results["metrics"]["arbitration"]["events"][0]["choice"] in ("speculative", "ar")
    # a choice table that measured this method slower than AR at every context bucket, batch 1: plain
    # decoding with no probe, and the same tokens
    from jaxspec.decoding.arbitration import ChoiceTable

    table = ChoiceTable([dict(method="dustin-kv-verify-set", context_bucket=2 ** i, batch=1, speedup=0.5)
                         for i in range(17)]).save(tmp_path / "choice.json")
    chosen = tmp_path / "table.json"
    assert main(_base(target, "--method", "dustin", "--budget", "2048", "--draft", str(draft), "--draft-kv",
                      "verify-set", "--arbitrate", "2", "--arbitrate-table", str(table), "--out", str(chosen))) == 0
    results = _results(chosen)
    (event,) = results["metrics"]["arbitration"]["events"]
    assert event["reason"] == "table" and event["choice"] == "ar" and event["probe"] is None
    assert results["tokens"] == _results(dense)["tokens"] and results["sparse"]["arbitrate"]["table_method"] == \
        "dustin-kv-verify-set"


def _profile(tmp_path, common, budgets, depths, max_new_tokens, srh_max_new_tokens, draft_layers=False):
    """`dustin-profile` on the tiny pair (calibration passkey tasks of 400 tokens): the profile's path. Random
    weights keep no draft layer; ``draft_layers`` gives every config two (heads 0-1 and 2-3) and m = 40."""
    profile = tmp_path / "profile.json"
    assert main(["dustin-profile", *common, "--budgets", budgets, "--lengths", "400", "--kinds", "passkey",
                 "--depths", depths, "--max-new-tokens", str(max_new_tokens), "--srh-max-new-tokens",
                 str(srh_max_new_tokens), "--recall-threshold", "-1", "--profile-file", str(profile),
                 "--out", str(tmp_path / "p.json")]) == 0
    if draft_layers:
        saved = json.loads(profile.read_text())
        for config in saved["configs"].values():
            config.update(draft_layers=[0, 1], draft_heads=[[0, 1], [2, 3]], m=40)
        profile.write_text(json.dumps(saved))
    return profile


def _pair_profile(folders, tmp_path, budgets, depths, max_new_tokens, srh_max_new_tokens):
    """The tiny pair's common arguments over a fresh haystack and a profile with draft layers (:func:`_profile`)."""
    target, draft = folders
    common = ["--model", str(target), "--draft", str(draft), "--source", str(_haystack(tmp_path)), "--gamma", "3"]
    return common, _profile(tmp_path, common, budgets, depths, max_new_tokens, srh_max_new_tokens, draft_layers=True)


def _haystack(tmp_path):
    import random

    words = "river meadow lantern harbour willow granite orchard velvet ember thistle cobalt saffron".split()
    rng = random.Random(0)
    text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + f" p{p}."
                       for p in range(400))
    path = tmp_path / "haystack.txt"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_profile_and_quality_commands(folders, tmp_path, capsys):
    """`dustin-profile` saves a profile with provenance from calibration tasks; `dustin-quality` loads it,
    checks it against the models, and writes one record per (item, method, k). With k = 512 above the
    ~400-token context every index-based method is exactly dense (ARR 1, identical output, same
    perplexity); with k = 128 the selections are sparse (ARR < 1)."""
    target, draft = folders
    haystack = _haystack(tmp_path)
    common = ["--model", str(target), "--draft", str(draft), "--source", str(haystack), "--gamma", "3"]
    profile = _profile(tmp_path, common, "128,512", "0.3,0.6", 4, 3)
    saved = json.loads(profile.read_text())
    assert saved["kind"] == "jaxspec.dustin.profile" and sorted(saved["configs"]) == ["128", "512"]
    assert saved["data"]["split"] == "calibration" and saved["data"]["disjoint_from_evaluation_checked"]
    assert all(t.startswith("calibration/") for t in saved["data"]["task_ids"])
    out = tmp_path / "quality.json"
    argv = ["dustin-quality", *common, "--dustin-profile", str(profile), "--budgets", "128,512", "--items", "400:1",
            "--kinds", "passkey", "--depths", "0.5", "--max-new-tokens", "6", "--ppl-tokens", "8", "--out", str(out),
            "--plot", str(tmp_path / "arr.png")]
    assert main(argv) == 0
    cases = json.loads(out.read_text())["cases"]
    item = next(k[:-len("/dense")] for k in cases if k.endswith("/dense"))
    assert item.startswith("evaluation/passkey/400/")
    dense = cases[f"{item}/dense"]
    assert len(cases) == 1 + 2 * 7 and (tmp_path / "arr.png").exists()
    for method in ("dustin-h", "dustin-t", "dustin-d", "streaming", "snapkv", "quest"):
        big, small = cases[f"{item}/{method}/k512"], cases[f"{item}/{method}/k128"]
        assert big["arr"] == pytest.approx(1.0, abs=1e-5), method
        assert big["match_rate"] == 1.0 and big["first_divergence"] is None and big["tokens"] == dense["tokens"]
        assert big["ppl"] == pytest.approx(dense["ppl"], rel=1e-4), method
        assert 0 < small["arr"] < 1, method
    assert cases[f"{item}/magicdec/k128"]["tokens"] == dense["tokens"]  # dense verification
    capsys.readouterr()
    assert main(argv) == 0  # a rerun resumes: nothing left to do
    assert "[resume] 15 case(s)" in capsys.readouterr().err and len(json.loads(out.read_text())["cases"]) == 15
    other = tmp_path / "other.json"
    assert main(argv[:argv.index("--out")] + ["--budgets", "256", "--out", str(other)]) == 2  # not profiled


def test_release_memory_drops_compiled_and_keeps_working():
    """`release_memory` trims the heap; with clear_compiled it also empties the module's jit table and
    JAX's caches, after which a jitted function recompiles and still gives the same values."""
    import jax.numpy as jnp

    from experiments import dustin_quality

    fn = dustin_quality.cached_jit("test/double", lambda x: 2 * x)
    assert float(fn(jnp.float32(3.0))) == 6.0
    dustin_quality.release_memory()  # trim only
    assert "test/double" in dustin_quality.JITS
    dustin_quality.release_memory(clear_compiled=True)
    assert "test/double" not in dustin_quality.JITS and fn._cache_size() == 0
    assert float(dustin_quality.cached_jit("test/double", lambda x: 2 * x)(jnp.float32(4.0))) == 8.0
    assert "rss" in dustin_quality.memory_summary()


def _k128_profile(folders, tmp_path):
    """The pair's common CLI arguments and a k = 128 profile calibrated on 400-token passkey tasks."""
    target, draft = folders
    common = ["--model", str(target), "--draft", str(draft), "--source", str(_haystack(tmp_path)), "--gamma", "3"]
    profile = tmp_path / "profile.json"
    assert main(["dustin-profile", *common, "--budgets", "128", "--lengths", "400", "--kinds", "passkey",
                 "--depths", "0.3", "--max-new-tokens", "3", "--srh-max-new-tokens", "2", "--recall-threshold", "-1",
                 "--profile-file", str(profile), "--out", str(tmp_path / "p.json")]) == 0
    return common, profile


@pytest.mark.slow
def test_quality_releases_compiled_code_between_lengths(folders, tmp_path, monkeypatch):
    """`dustin-quality` over two context lengths trims memory after each measurement and drops the
    compiled executables once, when the length changes (without it the process ran out of memory beyond 4k)."""
    from experiments.dustin_quality import quality

    common, profile = _k128_profile(folders, tmp_path)
    calls = []
    original = quality.release_memory
    monkeypatch.setattr(quality, "release_memory", lambda clear_compiled=False: (calls.append(clear_compiled),
                                                                             original(clear_compiled)))
    out = tmp_path / "quality.json"
    assert main(["dustin-quality", *common, "--dustin-profile", str(profile), "--budgets", "128", "--methods",
                 "dustin-h,quest", "--items", "400:1,480:1", "--kinds", "passkey", "--depths", "0.5",
                 "--max-new-tokens", "4", "--ppl-tokens", "8", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 2 * 3 and {r["context"] for r in cases.values()} == {400, 480}
    assert calls.count(True) == 1  # one length change
    # per item: 2 perplexities + dense + 2 decodes + the item's end
    assert calls.count(False) == 2 * 6


@pytest.mark.slow
def test_quality_input_aware_and_oracle_m(folders, tmp_path):
    """`dustin-quality --methods dustin-h,dustin-h-ia,dustin-h-cov,dustin-h-oracle`: per round the oracle's m maximises ARR
    (so its ARR bounds both rules, and its curve at the profiled m is the fixed rule's ARR); the
    input-aware record has its chosen m per round and the selection time beside the fixed rule's;
    with k = 512 above the ~400-token context all four are dense (same output)."""
    from experiments import dustin_quality

    target, draft = folders
    common, profile = _pair_profile(folders, tmp_path, "128,512", "0.3", 3, 2)
    out = tmp_path / "quality.json"
    assert main(["dustin-quality", *common, "--dustin-profile", str(profile), "--budgets", "128,512", "--methods",
                 "dustin-h,dustin-h-ia,dustin-h-cov,dustin-h-ent,dustin-h-oracle", "--items", "400:1", "--kinds", "passkey",
                 "--depths", "0.5",
                 "--max-new-tokens", "6", "--ppl-tokens", "8", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    item = next(k[:-len("/dense")] for k in cases if k.endswith("/dense"))
    dense = cases[f"{item}/dense"]
    fixed, aware, cover, oracle = (cases[f"{item}/{m}/k128"]
                                   for m in ("dustin-h", "dustin-h-ia", "dustin-h-cov", "dustin-h-oracle"))
    assert oracle["arr"] >= max(fixed["arr"], aware["arr"], cover["arr"]) - 1e-6
    assert oracle["fixed_arr_from_curve"] == pytest.approx(fixed["arr"], abs=1e-5)
    assert len(oracle["m_per_round"]) == len(aware["m_per_round"]) == len(cover["m_per_round"]) == dense["rounds"]
    assert set(cover["m_per_round"]) <= set(cover["m_candidates"]) and cover["m_candidates"][0] == fixed["m"]
    assert all(0 <= m <= 128 - 4 - 32 for m in aware["m_per_round"]) and aware["m_balance"] == (92 - 40) / 40
    assert aware["selection_s_fixed"] > 0 and aware["selection_s_input_aware"] > 0 and oracle["ppl"] is None
    entropy = cases[f"{item}/dustin-h-ent/k128"]  # the entropy rule: m, m -/+ round(0.1 * 92) per round
    assert entropy["m_candidates"] == [40, 31, 49] and set(entropy["m_per_round"]) <= {40, 31, 49}
    assert len(entropy["m_per_round"]) == dense["rounds"] and oracle["arr"] >= entropy["arr"] - 1e-6
    assert entropy["selection_s_input_aware"] > 0 and entropy["m_entropy_band"] == 0.05
    for method in ("dustin-h", "dustin-h-ia", "dustin-h-cov", "dustin-h-ent", "dustin-h-oracle"):
        assert cases[f"{item}/{method}/k512"]["tokens"] == dense["tokens"], method
        assert cases[f"{item}/{method}/k512"]["arr"] == pytest.approx(1.0, abs=1e-5)
    plot = tmp_path / "m.png"
    dustin_quality.plot_m_rules(cases, str(plot))
    assert plot.exists() and tables.m_rule_rows(cases)[0]["k"] == 128
    for rule in ("max-mass", "entropy"):
        assert main(["generate", "--model", str(target), "--method", "streaming", "--budget", "128", "--draft",
                     str(draft), "--dustin-m-rule", rule, "--prompt", "x"]) == 2


@pytest.mark.slow
def test_quality_held_coverage_rule(folders, tmp_path, capsys):
    """`dustin-quality --methods dustin-h-cov,dustin-h-cov-held --m-every 2`: on the same dense trajectory the held
    rule decides as the coverage rule in rounds 0, 2, 4, ... and keeps that m in the round after; with k = 512
    above the ~400-token context its output is dense. --m-every without the held method, or below 2, is refused."""
    common, profile = _pair_profile(folders, tmp_path, "128,512", "0.3", 3, 2)
    out = tmp_path / "quality.json"
    argv = ["dustin-quality", *common, "--dustin-profile", str(profile), "--budgets", "128,512", "--items", "400:1",
            "--kinds", "passkey", "--depths", "0.5", "--max-new-tokens", "16", "--ppl-tokens", "8"]
    assert main(argv + ["--methods", "dustin-h-cov,dustin-h-cov-held", "--m-every", "2", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    item = next(k[:-len("/dense")] for k in cases if k.endswith("/dense"))
    cover, held = cases[f"{item}/dustin-h-cov/k128"], cases[f"{item}/dustin-h-cov-held/k128"]
    rounds = cases[f"{item}/dense"]["rounds"]
    assert rounds >= 3 and len(held["m_per_round"]) == len(cover["m_per_round"]) == rounds
    for r, m in enumerate(held["m_per_round"]):
        assert m == (cover["m_per_round"][r] if r % 2 == 0 else held["m_per_round"][r - 1]), r
    assert held["m_rule"] == "coverage" and held["selection_s_input_aware"] > 0
    assert cases[f"{item}/dustin-h-cov-held/k512"]["tokens"] == cases[f"{item}/dense"]["tokens"]
    for extra, message in ((["--methods", "dustin-h-cov", "--m-every", "2"],
                            "--m-every=2 sets how often dustin-h-cov-held decides: add it to --methods"),
                           (["--methods", "dustin-h-cov-held", "--m-every", "1"], "--m-every=1: must be >= 2"),
                           (["--methods", "dustin-h-cov", "--m-every-schedule", "unrolled"],
                            "--m-every-schedule=unrolled sets how dustin-h-cov-held runs its rounds: add it to "
                            "--methods")):
        assert main(argv + extra + ["--out", str(tmp_path / "bad.json")]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "bad.json").exists()


@pytest.mark.slow
def test_generate_input_aware_m(folders, tmp_path):
    """`generate --method dustin --dustin-m-rule max-mass|coverage|entropy`: with k >= the context exactly
    dense ClassicSD (greedy == AR); labelled in the JSON."""
    target, draft = folders
    dense = tmp_path / "sd.json"
    assert main(_base(target, "--method", "sd", "--draft", str(draft), "--out", str(dense))) == 0
    for rule in ("max-mass", "coverage", "entropy"):
        path = tmp_path / f"{rule}.json"
        assert main(_base(target, "--method", "dustin", "--budget", "2048", "--draft", str(draft), "--dustin-m-rule",
                          rule, "--out", str(path))) == 0
        results = _results(path)
        assert results["tokens"] == _results(dense)["tokens"] and results["sparse"]["m_rule"] == rule


def test_quality_refuses_more_items_than_the_split_holds(folders, tmp_path, capsys):
    """1 kind x 2 depths x 1 sample = 2 tasks per length: asking for 3 fails before any model loads."""
    target, draft = folders
    argv = ["dustin-quality", "--model", str(target), "--draft", str(draft), "--source", str(_haystack(tmp_path)),
            "--dustin-profile", SMOL_PROFILE, "--budgets", "128", "--items", "400:3", "--kinds", "passkey",
            "--depths", "0.3,0.6", "--out", str(tmp_path / "q.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--items 400:3 asks for more items than the evaluation split holds" in err and "= 2); raise --samples" in err
    assert not (tmp_path / "q.json").exists()
    for extra, message in ((["--m-steps", "2"], "--m-steps=2 widens the coverage rule's candidates: add dustin-h-cov"),
                           (["--m-steps", "0", "--methods", "dustin-h-cov"], "--m-steps=0: must be >= 1")):
        assert main(argv[:-2] + extra + ["--out", str(tmp_path / "q.json")]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "q.json").exists()


def test_profile_extension_adds_budgets_and_keeps_the_rest(folders, tmp_path, capsys):
    """`dustin-profile --extend FILE --budgets K`: the profile's SRHs and configs stay as they were, k = K is
    searched on calibration rounds at the new lengths, and the calibration haystacks are merged (the quality
    command's evaluation-overlap check sees both). A budget the profile has already is refused before any
    model loads; dustin-quality then runs with the new k."""
    target, draft = folders
    haystack = _haystack(tmp_path)
    first, extended = tmp_path / "profile.json", tmp_path / "extended.json"
    common = ["--model", str(target), "--draft", str(draft), "--source", str(haystack), "--gamma", "3"]
    assert main(["dustin-profile", *common, "--budgets", "128", "--lengths", "400", "--kinds", "passkey",
                 "--depths", "0.5", "--max-new-tokens", "4", "--srh-max-new-tokens", "3", "--recall-threshold", "-1",
                 "--profile-file", str(first), "--out", str(tmp_path / "p.json")]) == 0
    argv = ["dustin-profile", *common, "--extend", str(first), "--budgets", "256", "--lengths", "700",
            "--kinds", "passkey", "--depths", "0.5", "--max-new-tokens", "4", "--profile-file", str(extended),
            "--out", str(tmp_path / "e.json")]
    assert main(argv) == 0
    before, after = json.loads(first.read_text()), json.loads(extended.read_text())
    assert sorted(after["configs"]) == ["128", "256"] and after["configs"]["128"] == before["configs"]["128"]
    assert after["srh"] == before["srh"] and after["search"]["128"] == before["search"]["128"]
    assert after["configs"]["256"]["budget"] == 256 and "256" in after["search"]
    (ext,) = after["data"]["extensions"]
    assert ext["budgets"] == [256] and ext["context_tokens"] == [700] and ext["split"] == "calibration"
    assert set(before["data"]["haystack_sha256"]) | set(ext["haystack_sha256"]) == set(after["data"]["haystack_sha256"])
    capsys.readouterr()
    again = argv[:argv.index("--extend") + 1] + [str(extended)] + argv[argv.index("--extend") + 2:]
    assert main(again) == 2
    assert "already has k=[256]" in capsys.readouterr().err
    out = tmp_path / "quality.json"
    assert main(["dustin-quality", *common, "--dustin-profile", str(extended), "--budgets", "256", "--items", "700:1",
                 "--kinds", "passkey", "--depths", "0.5", "--methods", "dustin-h", "--max-new-tokens", "4",
                 "--ppl-tokens", "8", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert any(k.endswith("/dustin-h/k256") for k in cases)
    dense = next(c for k, c in cases.items() if k.endswith("/dense"))
    assert set(dense["phase_seconds"]) >= {"prefill", "perplexity", "extend", "dense_decode_with_arr"}


@pytest.mark.slow
def test_quality_compiles_once_per_context_length(folders, tmp_path):
    """Items of one context length share every compiled program: the second item (another task kind, so
    other question and prompt lengths) compiles nothing -- each record counts the XLA programs built for it."""
    common, profile = _k128_profile(folders, tmp_path)
    out = tmp_path / "quality.json"
    assert main(["dustin-quality", *common, "--dustin-profile", str(profile), "--budgets", "128", "--methods",
                 "dustin-h,quest,snapkv", "--items", "400:2", "--samples", "1", "--kinds", "passkey,kv_retrieval",
                 "--depths", "0.5", "--max-new-tokens", "4", "--ppl-tokens", "8", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    dense = [k for k in cases if k.endswith("/dense")]
    assert len(dense) == 2 and len({cases[k]["prompt_tokens"] for k in dense}) == 2
    first, second = (k[:-len("/dense")] for k in dense)
    assert cases[f"{first}/dense"]["compiles"]["count"] > 0
    built = {k: r["compiles"]["count"] for k, r in cases.items() if k.startswith(second)}
    assert set(built) == {f"{second}/{m}" for m in ("dense", "dustin-h/k128", "quest/k128", "snapkv/k128")}
    assert all(n == 0 for n in built.values()), built


def test_replace_options_and_warm_worker_checks(monkeypatch):
    """Warm-up workers start from the run's own command line with some options replaced; a warm-up
    that cannot work is refused with the value and what is valid."""
    from experiments.common import check_warm_workers, replace_options

    argv = ["--model", "m", "--methods=a,b", "--items", "400:3", "--plot", "p.png", "--gamma", "3"]
    assert replace_options(argv, {"--methods": "a", "--items": "400:1", "--plot": None}) == [
        "--model", "m", "--gamma", "3", "--methods", "a", "--items", "400:1"]
    check_warm_workers(1, None, 3)  # 1: no warm-up, nothing needed
    for workers, argv_, message in ((0, ["x"], "must be >= 1"), (4, ["x"], r"at most one worker per method \(3 here\)"),
                                    (2, None, "command line")):
        with pytest.raises(ValueError, match=message):
            check_warm_workers(workers, argv_, 3)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    from experiments import common

    monkeypatch.setattr(common, "compilation_cache_on", lambda: True)
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_PREALLOCATE=false"):
        check_warm_workers(2, ["x"], 3)
    monkeypatch.setattr(common, "compilation_cache_on", lambda: False)
    with pytest.raises(ValueError, match="compilation cache"):
        check_warm_workers(2, ["x"], 3)


@pytest.mark.slow
def test_quality_warm_workers_leave_the_run_nothing_to_compile(folders, tmp_path):
    """`dustin-quality --warm-workers 2` in a fresh compilation cache: two processes, each with a share of
    the methods and one item, compile in parallel; the run then loads every program of its first item
    from the cache (no miss)."""
    import os
    import subprocess
    import sys

    common, profile = _k128_profile(folders, tmp_path)
    argv = ["dustin-quality", *common, "--dustin-profile", str(profile), "--budgets", "128", "--methods",
            "dustin-h,quest", "--items", "400:1", "--kinds", "passkey", "--depths", "0.5",
            "--max-new-tokens", "4", "--ppl-tokens", "8"]
    repo = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, JAXSPEC_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu", PYTHONPATH=str(repo))
    warm = tmp_path / "warm.json"
    run = subprocess.run([sys.executable, "-m", "experiments.run", *argv, "--warm-workers", "2", "--out", str(warm)],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(warm.read_text())
    [warm_up] = data["warm_up"]
    assert [w["returncode"] for w in warm_up["workers"]] == [0, 0]
    assert [w["options"]["--methods"] for w in warm_up["workers"]] == ["dustin-h", "quest"]
    assert warm_up["first_item"]["cache_misses"] == 0 and warm_up["first_item"]["cache_hits"] > 0, warm_up
    assert "warm_workers" not in data["config"] and "argv" not in data["config"]
    assert len(data["cases"]) == 3  # dense + two methods


def test_m_bounds_command(folders, tmp_path, capsys):
    """`dustin-m-bounds` decodes evaluation tasks with full-KV verification, recording every round, and
    reports per k the mean ARR of fixed m, the per-round oracle, the three per-round choices and the best
    single m (none above the oracle) with the share of the gap each closes; without a profile it stops before loading."""
    common, profile = _pair_profile(folders, tmp_path, "128", "0.3,0.6", 4, 3)
    out = tmp_path / "bounds.json"
    argv = ["dustin-m-bounds", *common, "--dustin-profile", str(profile), "--budgets", "128", "--lengths", "400",
            "--kinds", "passkey", "--depths", "0.5", "--samples", "2", "--items", "2", "--max-new-tokens", "8",
            "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    study = data["k128"]
    assert len(data["tasks"]) == 2 and all(t.startswith("evaluation/passkey/400/") for t in data["tasks"])
    assert study["sequences"] == 2 and study["rounds"] >= 2
    arr = study["arr"]
    assert all(arr["oracle"] >= arr[name] - 1e-6 for name in arr)
    assert set(study["gap_closed"]) == {"persistence", "signal_proxy", "hindsight", "best_fixed",
                                        "best_fixed_crossval", "coverage", "coverage_crossval",
                                        "coverage_held3"}  # the rule deciding every third round
    assert arr["fixed"] <= arr["best_fixed"] + 1e-6  # the profile's m is one of the single m's searched
    assert arr["best_fixed_crossval"] <= arr["best_fixed"] + 1e-6 and len(study["best_fixed_m"]["folds"]) == 2
    assert study["oracle_m"]["min"] <= study["oracle_m"]["mean"] <= study["oracle_m"]["max"]
    capsys.readouterr()
    assert main(argv[:argv.index("--dustin-profile")] + ["--out", str(tmp_path / "none.json")]) == 2
    assert "--dustin-profile" in capsys.readouterr().err and not (tmp_path / "none.json").exists()


@pytest.mark.slow
def test_m_recalibrated_per_context_length(folders, tmp_path, capsys):
    """`dustin-profile --extend FILE --recalibrate-m --lengths ...` (docs/methods.md §3.7): the layers stay, each
    budget gets an m per calibrated length (its profiled m at the length it was profiled on) with the ARR curve
    it maximises; `dustin-m-bounds` then scores that m and the coverage rule around it, and `dustin-quality
    --dustin-m-per-length` decodes with it. Without --extend, or with a profile that has no table, a one-line error
    before any model loads."""
    from jaxspec.dustin.search import DustinProfile

    common, profile = _pair_profile(folders, tmp_path, "128", "0.3,0.6", 4, 3)
    recal = tmp_path / "per-length.json"
    argv = ["dustin-profile", *common, "--budgets", "128", "--lengths", "600,800", "--kinds", "passkey",
            "--depths", "0.5", "--max-new-tokens", "6", "--profile-file", str(recal), "--out", str(tmp_path / "r.json")]
    capsys.readouterr()
    assert main(argv + ["--recalibrate-m"]) == 2
    assert "--extend" in capsys.readouterr().err and not recal.exists()
    bare = tmp_path / "bare.json"  # a profile whose k=128 config kept no draft layer: no split to recalibrate
    saved = json.loads(profile.read_text())
    saved["configs"]["128"].update(draft_layers=[], draft_heads=[], m=None)
    bare.write_text(json.dumps(saved))
    assert main(argv + ["--extend", str(bare), "--recalibrate-m"]) == 2
    assert "no split m to recalibrate" in capsys.readouterr().err and not recal.exists()
    assert main(argv + ["--extend", str(profile), "--recalibrate-m"]) == 0
    before, after = json.loads(profile.read_text()), json.loads(recal.read_text())
    assert after["configs"] == before["configs"] and after["srh"] == before["srh"]
    table = after["m_by_length"]["128"]
    assert sorted(table, key=int) == ["400", "600", "800"] and table["400"] == 40  # the profiled m where profiled
    for length in ("600", "800"):
        found = after["search"]["128"]["m_by_length"][length]
        assert table[length] == found["m"] == int(np.argmax(found["m_curve"])) and found["rounds"] >= 1
        assert found["arr"] == pytest.approx(max(found["m_curve"]), abs=1e-6) and found["profile_m"] == 40
    (part,) = after["data"]["m_recalibrations"]
    assert part["lengths"] == [600, 800] and part["profiled_m_at"] == {"128": 400}
    loaded = DustinProfile.load(recal)
    out = tmp_path / "bounds.json"
    assert main(["dustin-m-bounds", *common, "--dustin-profile", str(recal), "--budgets", "128", "--lengths", "700",
                 "--kinds", "passkey", "--depths", "0.5", "--samples", "2", "--items", "2", "--max-new-tokens", "6",
                 "--out", str(out)]) == 0
    study = json.loads(out.read_text())["k128"]
    assert study["length_m"] == loaded.m_at(128, 700)
    assert study["arr"]["length_m"] <= study["arr"]["best_fixed"] + 1e-6 and "coverage_length_m" in study["gap_closed"]
    quality = tmp_path / "quality.json"
    q_argv = ["dustin-quality", *common, "--budgets", "128", "--items", "800:1", "--kinds", "passkey", "--depths",
              "0.5", "--methods", "dustin-h,dustin-h-cov", "--max-new-tokens", "4", "--ppl-tokens", "8",
              "--dustin-m-per-length", "--out", str(quality)]
    capsys.readouterr()
    assert main(q_argv[:1] + ["--dustin-profile", str(profile)] + q_argv[1:]) == 2
    assert "no m per context length" in capsys.readouterr().err and not quality.exists()
    assert main(q_argv[:1] + ["--dustin-profile", str(recal)] + q_argv[1:]) == 0
    cases = json.loads(quality.read_text())["cases"]
    (fixed,) = [c for k, c in cases.items() if k.endswith("/dustin-h/k128")]
    (cov,) = [c for k, c in cases.items() if k.endswith("/dustin-h-cov/k128")]
    assert fixed["m"] == table["800"] and cov["m_candidates"][0] == table["800"]
