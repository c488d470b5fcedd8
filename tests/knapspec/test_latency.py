"""KnapSpec latency model fitted on whole forwards (``--latency-fit forward``): the fit, the
profiler (mocked clock and a real tiny model), the profile file and the experiment option."""

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.knapspec import latency
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit, init_params

TINY = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype="float32", name="tiny-forward-fit")
TRUE = latency.LatencyModel(c1=1.8e-4, c2=6.8e-8, c3=9.8e-5, c0=4.0e-3, v=0.12, u=2.5e-5, u_n=3.0e-9)


def synthetic_times(model, L, kind, n, rows=1, verify_context=None):
    """Step times generated from ``model``: what a device that follows it exactly would measure."""
    S = latency.skippable_sublayers(L)
    full = model.t_step(n, L)
    if kind == "full":
        return full
    if kind == "noattn":
        return full - S * model.t_attn(n)
    if kind == "nomlp":
        return full - S * model.t_mlp()
    if kind == "bulk":  # many rows: the price u + u_n n a row, whatever the few-row slope v says
        return full * model.a + model.t_row(n) * (rows - 1)
    if kind == "plain":  # the decode loop's own step
        return model.t_plain(n, L)
    assert kind == "verify"
    return full * (model.a + model.v * (rows - 1))


def test_forward_skip_masks_never_skip_first_and_last_layer():
    masks = latency.forward_skip_masks(5)
    assert not masks["full"].any()
    assert masks["noattn"][:, 0].tolist() == [False, True, True, True, False] and not masks["noattn"][:, 1].any()
    assert masks["nomlp"][:, 1].tolist() == [False, True, True, True, False] and not masks["nomlp"][:, 0].any()
    assert latency.skippable_sublayers(5) == 3 and latency.skippable_sublayers(2) == 0


def test_half_skip_masks_skip_every_second_skippable_sublayer():
    for L, layers in ((6, [1, 3]), (5, [1, 3]), (28, list(range(1, 27, 2))), (3, [1])):
        masks = latency.forward_skip_masks(L, half=True)
        assert np.flatnonzero(masks["noattn"][:, 0]).tolist() == layers and not masks["noattn"][:, 1].any()
        assert np.flatnonzero(masks["nomlp"][:, 1]).tolist() == layers and not masks["nomlp"][:, 0].any()
        assert len(layers) == -(-latency.skippable_sublayers(L) // 2) and not masks["full"].any()
    assert [latency.fit_method(s, h) for s in (False, True) for h in (False, True)] == [
        "forward", "forward-half", "forward-static", "forward-static-half"]
    assert set(latency.PROFILERS) == set(latency.FIT_METHODS)
    from experiments.knapspec import flags, latency_profiles
    assert flags.LATENCY_FITS == latency.FIT_METHODS
    assert [latency_profiles._forward_fit_kwargs(m) for m in ("forward", "forward-static", "forward-static-half")] == [
        {}, {"static_masks": True}, {"static_masks": True, "half_masks": True}]


def test_half_mask_fit_prices_a_half_plan_where_the_all_mask_fit_overprices_it():
    """A synthetic device whose savings are not additive: skipping k of the S sub-layers of a kind saves
    ``price * S * (k / S) ** 1.5`` (skipping half saves about a third of skipping all; on an H100 at batch 1
    savings within a kind were additive, docs/methods.md §4.1). The fit on the all-or-nothing masks then
    overprices the saving of a plan skipping about half of each kind (predicts it too fast); the fit on the
    half masks prices exactly the plans of that size."""
    L, n = 28, np.array([2048.0, 12000.0, 22000.0, 32768.0])
    S = latency.skippable_sublayers(L)

    def step(model, n, k_attn, k_mlp):
        saving = lambda k, price: price * S * (k / S) ** 1.5
        return model.t_step(n, L) - saving(k_attn, model.t_attn(n)) - saving(k_mlp, model.t_mlp())

    half = -(-S // 2)

    def profile(k):
        return latency.fit_forward(n, [step(TRUE, x, 0, 0) for x in n], [step(TRUE, x, k, 0) for x in n],
                                   [step(TRUE, x, 0, k) for x in n], L, skipped=None if k == S else k)

    (all_model, all_fit), (half_model, half_fit) = profile(S), profile(half)
    assert all_fit["skipped"] == S and half_fit["skipped"] == half and half_fit["skippable"] == S

    def predicted(model, x, k_attn, k_mlp):
        return model.t_step(x, L) - k_attn * model.t_attn(x) - k_mlp * model.t_mlp()

    for x in (4000.0, 32768.0):
        measured = step(TRUE, x, half, half)
        # each fit reproduces the full step and the steps of its own masks
        assert predicted(half_model, x, 0, 0) == pytest.approx(step(TRUE, x, 0, 0), rel=1e-9)
        assert predicted(half_model, x, half, 0) == pytest.approx(step(TRUE, x, half, 0), rel=1e-6)
        assert predicted(all_model, x, S, 0) == pytest.approx(step(TRUE, x, S, 0), rel=1e-6)
        # a plan of the half masks' size: exact by the half fit, too fast by the all fit, which credits
        # each skipped sub-layer with its share of skipping them all
        assert predicted(half_model, x, half, half) == pytest.approx(measured, rel=1e-6)
        assert predicted(all_model, x, half, half) < measured * 0.97
    with pytest.raises(ValueError, match=r"skipped=27: the profiled masks skip 1..26"):
        latency.fit_forward(n, [1.0] * 4, [0.9] * 4, [0.9] * 4, L, skipped=27)


def test_forward_fit_recovers_a_synthetic_linear_model_exactly():
    L, n = 30, np.array([512.0, 1500.0, 3000.0, 4200.0])
    rows = [1, 2, 4, 8, 11]
    times = {k: [synthetic_times(TRUE, L, k, x) for x in n] for k in ("full", "noattn", "nomlp")}
    verify = [synthetic_times(TRUE, L, "verify", n.max(), r) for r in rows]
    model, fit = latency.fit_forward(n, times["full"], times["noattn"], times["nomlp"], L, verify_rows=rows,
                                     verify_times=verify)
    for name in ("c0", "c1", "c2", "c3", "v", "a"):
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=1e-8), name
    assert fit["clamped"] == [] and fit["skippable"] == L - 2
    assert model.t_step(2000, L) == pytest.approx(TRUE.t_step(2000, L), rel=1e-12)
    # a negative per-token residual (skipping saved more than the layer's share) is clamped at 0 and reported
    low = dataclasses.replace(TRUE, c0=0.0)  # every forward 0.1 ms below what its sub-layers add up to
    times = {k: [synthetic_times(low, L, k, x) - 1e-4 for x in n] for k in ("full", "noattn", "nomlp")}
    clamped, fit = latency.fit_forward(n, times["full"], times["noattn"], times["nomlp"], L)
    assert clamped.c0 == 0.0 and fit["c0_raw"] == pytest.approx(-1e-4, rel=1e-6) and fit["clamped"] == ["c0"]
    assert clamped.v == 0.0 and clamped.c1 == pytest.approx(TRUE.c1, rel=1e-8)
    with pytest.raises(ValueError, match="needs >= 3 layers"):
        latency.fit_forward(n, times["full"], times["noattn"], times["nomlp"], 2)
    with pytest.raises(ValueError, match="two distinct context"):
        latency.fit_forward([8, 8], [2.0, 2.0], [1.0, 1.0], [1.0, 1.0], 4)
    with pytest.raises(ValueError, match="nomlp times must be positive"):
        latency.fit_forward([8, 9], [2.0, 2.0], [1.0, 1.0], [1.0, float("nan")], 4)


def test_forward_fit_recovers_the_target_forward_ratio():
    """The target's own forwards (no skip mask) cost ``a`` draft-form steps: on a GPU the dynamic
    mask's conditionals make the draft-form step dearer (a < 1), on the CPU cheaper (a > 1)."""
    L, n, rows = 30, np.array([512.0, 1500.0, 3000.0]), [1, 2, 4, 11]
    for a in (0.45, 1.35):
        true = dataclasses.replace(TRUE, a=a)
        times = {k: [synthetic_times(true, L, k, x) for x in n] for k in ("full", "noattn", "nomlp")}
        verify = [synthetic_times(true, L, "verify", n.max(), r) for r in rows]
        model, fit = latency.fit_forward(n, times["full"], times["noattn"], times["nomlp"], L, verify_rows=rows,
                                         verify_times=verify)
        assert model.a == pytest.approx(a, rel=1e-8) and model.v == pytest.approx(TRUE.v, rel=1e-8)
        assert fit["verify_one_row_over_step"] == pytest.approx(a, rel=1e-8) and fit["clamped"] == []
    # a profile with ``a`` round-trips; one written before ``a`` existed loads with a = 1
    assert latency.LatencyModel(**dataclasses.replace(TRUE, a=0.5).as_dict()).a == 0.5
    assert latency.LatencyModel(**{k: v for k, v in TRUE.as_dict().items() if k != "a"}).a == 1.0
    # the decode loop's step: measured (p) or, where it was not, the one-row forward's (a)
    old = latency.LatencyModel(**{k: v for k, v in TRUE.as_dict().items() if k != "p"})
    assert old.p == 0.0 and old.t_plain(700, 30) == pytest.approx(old.a * old.t_step(700, 30))
    assert dataclasses.replace(TRUE, p=0.7).t_plain(700, 30) == pytest.approx(0.7 * TRUE.t_step(700, 30))


def _mock_profile(config=TINY, model=TRUE, steps=3, contexts=(128, 256, 512), overhead=0.0, **kwargs):
    """The forward profiler with its clock replaced by ``model`` (no forward is run); each call also
    pays ``overhead`` seconds once (``overhead(kind)``: per kind of call)."""
    seen = []

    def timer(key, call):
        kind, n, rows, k = key
        seen.append(key[:3])
        fixed = overhead(kind) if callable(overhead) else overhead
        return k * synthetic_times(model, config.num_layers, kind, n, rows) + fixed  # seconds of one call

    profile = latency.profile_latency_forward(config, 1, contexts, steps_per_call=steps, timer=timer, **kwargs)
    return profile, seen


def test_forward_profiler_with_a_mocked_clock_recovers_the_model():
    profile, seen = _mock_profile(warmup=1, repeats=2)
    # round-robin: the three variants of a context (and the full one in long calls) alternate, warm-up round
    # included (3 rounds)
    assert [k for k, n, _ in seen if n == 128] == ["full", "noattn", "nomlp", "full"] * 3
    assert len(profile.forward["samples"]["full"][0]) == 2
    assert {k for k, _, _ in seen} == {"full", "noattn", "nomlp", "verify", "bulk", "plain"}
    # the decode loop timed at the largest context beside the full step: p recovered (TRUE has none: a)
    assert {n for k, n, _ in seen if k == "plain"} == {512}
    assert profile.model.p == pytest.approx(TRUE.a, rel=1e-8)
    cpu_like, _ = _mock_profile(model=dataclasses.replace(TRUE, a=1.4, p=0.9))
    assert cpu_like.model.p == pytest.approx(0.9, rel=1e-8) and cpu_like.model.a == pytest.approx(1.4, rel=1e-8)
    assert cpu_like.model.t_plain(300, TINY.num_layers) == pytest.approx(0.9 * TRUE.t_step(300, TINY.num_layers))
    # contexts 128 / 256 / 512: only 512 exceeds the 256 rows, so one bulk context and no context slope
    assert [r for k, n, r in seen if k == "bulk"] == list(latency.DEFAULT_BULK_ROWS) * 3
    assert {n for k, n, r in seen if k == "bulk"} == {512} and profile.forward["bulk_contexts"] == [512]
    assert [r for k, n, r in seen if k == "verify"] == list(latency.DEFAULT_VERIFY_ROWS) * 3
    assert {n for k, n, r in seen if k == "verify"} == {512}  # verification at the largest context
    for name in ("c0", "c1", "c2", "c3", "v"):
        assert getattr(profile.model, name) == pytest.approx(getattr(TRUE, name), rel=1e-8), name
    # one bulk context: the row price measured there, flat in the context
    assert profile.model.u_n == 0.0 and profile.model.t_row(128) == pytest.approx(TRUE.t_row(512), rel=1e-8)
    assert profile.method == "forward" and profile.verify_rows == 11
    assert profile.forward["times"]["full"][0] == pytest.approx(TRUE.t_step(128, TINY.num_layers))
    with pytest.raises(ValueError, match="above 11"):
        _mock_profile(contexts=(8, 512))
    with pytest.raises(ValueError, match="largest context 200 must exceed the most rows 256"):
        _mock_profile(contexts=(128, 200))
    with pytest.raises(ValueError, match=r"bulk_rows=\[64\]: need >= 2 distinct"):
        _mock_profile(bulk_rows=(64,))
    unmeasured, seen = _mock_profile(bulk_rows=())
    assert unmeasured.model.u == 0.0 and unmeasured.model.t_row(4096) == 0.0 and "bulk" not in {k for k, _, _ in seen}


def test_forward_profiler_takes_each_calls_fixed_cost_off_its_steps():
    """A device that pays a fixed cost per call (dispatch, the host waiting) beside its steps: the full
    forward timed at two call lengths measures it, and the fit recovers the per-step model exactly --
    plain decoding's ratio ``p`` too, where the decode loop's call costs more than the forward loop's.
    Without the long calls the fixed cost lands in every step (c0, p: plain decoding priced too dear)."""
    dev = dataclasses.replace(TRUE, p=0.9)
    fixed = {"plain": 4e-3}  # the decode loop's call; every other call 2.5 ms

    def per_call(kind):
        return fixed.get(kind, 2.5e-3)

    profile, seen = _mock_profile(model=dev, overhead=per_call, steps=4)
    assert profile.forward["long_steps_per_call"] == 16 and {r for k, n, r in seen if k == "plain"} == {1}
    for name in ("c0", "c1", "c2", "c3", "v", "a", "p"):
        assert getattr(profile.model, name) == pytest.approx(getattr(dev, name), rel=1e-6), name
    assert profile.forward["call_overhead"] == pytest.approx([2.5e-3] * 3, rel=1e-6)
    assert profile.forward["fit"]["plain_call_overhead"] == pytest.approx(4e-3, rel=1e-6)
    kept, _ = _mock_profile(model=dev, overhead=per_call, steps=4, long_steps_per_call=0)
    assert kept.forward["call_overhead"] == [0.0] * 3 and "plain_call_overhead" not in kept.forward["fit"]
    assert kept.model.c0 == pytest.approx(dev.c0 + 2.5e-3 / 4, rel=1e-6)  # the fixed cost in every step
    assert kept.model.t_plain(512, TINY.num_layers) > 1.05 * dev.t_plain(512, TINY.num_layers)
    with pytest.raises(ValueError, match="long_steps_per_call=4: must exceed steps_per_call=4"):
        _mock_profile(steps=4, long_steps_per_call=4)


def test_call_overhead_from_two_call_lengths():
    # 4 steps of 1 ms in a call of 5 ms, 16 in 17 ms: 1 ms fixed
    assert latency.call_overhead(5e-3 / 4, 17e-3 / 16, 4, 16) == pytest.approx(1e-3)
    assert latency.call_overhead(1e-3, 1.1e-3, 4, 16) == 0.0  # noise: a long call dearer per step
    assert latency.call_overhead(1e-3, 1e-5, 4, 16) == pytest.approx(2e-3)  # never more than half a call
    with pytest.raises(ValueError, match="call lengths 4 and 4"):
        latency.call_overhead(1e-3, 1e-3, 4, 4)


def test_forward_profiler_prices_a_dp_row_per_context():
    """The many-row forwards run at the smallest context above the most rows and at the largest;
    the line through their slopes recovers ``u + u_n n`` (a row attends to the whole context)."""
    profile, seen = _mock_profile(contexts=(300, 1024, 4096))
    assert sorted({n for k, n, r in seen if k == "bulk"}) == [300, 4096] == profile.forward["bulk_contexts"]
    assert profile.model.u == pytest.approx(TRUE.u, rel=1e-8) and profile.model.u_n == pytest.approx(TRUE.u_n, rel=1e-8)
    for n in (300, 2000, 32768):
        assert profile.model.t_row(n) == pytest.approx(TRUE.t_row(n), rel=1e-8)
    assert profile.forward["fit"]["u_per_context"] == pytest.approx([TRUE.t_row(300), TRUE.t_row(4096)], rel=1e-8)
    assert profile.forward["bulk_times"] == profile.forward["bulk_times_per_context"][-1]
    # a price that falls with the context (noise) is replaced by the dearer slope everywhere, and said so
    u, u_n, clamped = latency.row_price_line([300, 4096], [2e-5, 1e-5])
    assert (u, u_n, clamped) == (2e-5, 0.0, ["u_n"])
    assert latency.row_price_line([4096], [-1e-6]) == (0.0, 0.0, ["u"])
    with pytest.raises(ValueError, match="one or two"):
        latency.row_price_line([1, 2, 3], [1e-5, 2e-5, 3e-5])
    # the same forwards' intercept: what a pass pays whatever its rows (here the full step x a, less one row)
    L = TINY.num_layers
    for n in (300, 4096):
        assert profile.model.t_pass(n) == pytest.approx(TRUE.t_step(n, L) * TRUE.a - TRUE.t_row(n), rel=1e-6)
    assert profile.forward["fit"]["w"] == pytest.approx(profile.model.w)
    # a profile saved before the pass price gets it from its own many-row forwards when read
    data = json.loads(profile.to_json())
    del data["model"]["w"], data["model"]["w_n"]
    older = latency.LatencyProfile.from_json(json.dumps(data))
    assert (older.model.w, older.model.w_n) == pytest.approx((profile.model.w, profile.model.w_n))
    assert latency.pass_price([], [], []) == (0.0, 0.0, [])
    assert latency.pass_price([64, 256], [300, 4096], [[2.0, 3.0], [1.0, 2.0]])[2] == ["w_n"]  # falls: clamped
    assert latency.bulk_profile_contexts([128, 256, 512], [64, 256]) == [512]
    assert latency.bulk_profile_contexts([128, 256], [64, 256]) == [] and latency.bulk_profile_contexts([512], []) == []


def test_forward_profile_round_trip_and_file_errors(tmp_path):
    profile, _ = _mock_profile()
    path = tmp_path / "p" / "forward.json"
    profile.save(path)
    assert latency.LatencyProfile.load(path) == profile
    assert json.loads(path.read_text())["format_version"] == latency.FORMAT_VERSION == 7

    def must_not_profile(*args, **kwargs):
        raise AssertionError("profiled although a matching profile was saved")

    assert latency.load_or_profile(path, TINY, 1, method="forward", profile_fn=must_not_profile) == profile
    with pytest.raises(ValueError, match="method 'forward', not the requested 'isolated'"):
        latency.load_or_profile(path, TINY, 1, method="isolated", profile_fn=must_not_profile)
    with pytest.raises(ValueError, match="'bogus'"):
        latency.load_or_profile(path, TINY, 1, method="bogus")
    # older forward profiles load, but are measured again: format 4 (before the many-row slope: no bulk rows)
    # and format 5 (the slope at one context only: no per-context price)
    # and format 6 (before each call's fixed cost was measured: no long calls)
    for version, model_key, forward_key in ((4, "u", "bulk_rows"), (5, "u_n", "bulk_contexts"),
                                            (6, None, "long_steps_per_call")):
        old = json.loads(path.read_text())
        old["format_version"] = version
        del old["forward"][forward_key]
        if model_key:
            del old["model"][model_key]
        older = tmp_path / f"format{version}.json"
        older.write_text(json.dumps(old))
        if model_key:
            assert getattr(latency.LatencyProfile.load(older).model, model_key) == 0.0
        remeasured = []
        assert latency.load_or_profile(older, TINY, 1, method="forward",
                                       profile_fn=lambda cfg, b: remeasured.append(b) or profile) == profile
        assert remeasured == [1] and latency.LatencyProfile.load(older) == profile, version
    # a format-3 file (before the method field) still loads, as an isolated fit
    old = json.loads(path.read_text())
    old["format_version"] = 3
    del old["method"], old["forward"]
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps(old))
    loaded = latency.LatencyProfile.load(legacy)
    assert loaded.method == "isolated" and loaded.model == profile.model and loaded.forward == {}
    # corrupt files: a clear error naming the value, and the file is left alone
    for change, message in ((lambda d: d.update(method="bogus"), "method 'bogus'"),
                            (lambda d: d["model"].update(c1="fast"), "c1 = 'fast'"),
                            (lambda d: d["model"].update(v=float("inf")), "v = inf"),
                            (lambda d: d.update(batch=0), "batch 0"),
                            (lambda d: d.pop("contexts"), r"missing fields \['contexts'\]"),
                            (lambda d: d.update(format_version=99), "format_version 99")):
        data = json.loads(path.read_text())
        change(data)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            latency.LatencyProfile.load(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON.*delete or move"):
        latency.load_or_profile(bad, TINY, 1, method="forward", profile_fn=must_not_profile)
    assert bad.read_text() == "{not json"
    # an older format is still measured again (as before), and the old file is kept aside, not overwritten
    data = json.loads(path.read_text())
    data["format_version"] = 2
    bad.write_text(json.dumps(data))
    older = bad.read_text()
    calls = []
    latency.load_or_profile(bad, TINY, 1, method="forward",
                            profile_fn=lambda cfg, b: calls.append(b) or profile)
    assert calls == [1] and latency.LatencyProfile.load(bad) == profile
    (aside,) = tmp_path.glob("bad.replaced-*.json")
    assert aside.read_text() == older


def test_remeasure_keeps_the_old_profile_and_a_failed_measurement_loses_nothing(tmp_path):
    """``remeasure=True`` measures although a matching profile is saved (a profile does not record the
    code it timed); the old file is renamed, not overwritten, and only once the new one is measured."""
    old, _ = _mock_profile()
    new, _ = _mock_profile(model=dataclasses.replace(TRUE, c1=2 * TRUE.c1))
    assert new.model != old.model
    path = tmp_path / "forward.json"
    old.save(path)
    before = path.read_text()

    def fails(cfg, b):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        latency.load_or_profile(path, TINY, 1, method="forward", profile_fn=fails, remeasure=True)
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["forward.json"]
    calls = []
    got = latency.load_or_profile(path, TINY, 1, method="forward", remeasure=True,
                                  profile_fn=lambda cfg, b: calls.append(b) or new)
    assert calls == [1] and got == new and latency.LatencyProfile.load(path) == new
    (aside,) = [p for p in tmp_path.iterdir() if p.name != "forward.json"]
    assert aside.name.startswith("forward.replaced-") and aside.name.endswith(".json")
    assert aside.read_text() == before
    # again within the same second: a second name, the first kept
    latency.load_or_profile(path, TINY, 1, method="forward", remeasure=True, profile_fn=lambda cfg, b: old)
    assert len(list(tmp_path.iterdir())) == 3 and latency.LatencyProfile.load(path) == old
    assert latency.LatencyProfile.load(aside) == old and aside.read_text() == before
    # without remeasure the saved profile is used as before
    assert latency.load_or_profile(path, TINY, 1, method="forward", profile_fn=fails) == old


def test_forward_profile_times_the_draft_forward_of_a_tiny_model():
    """Real clock on a 3-layer model: positive times, and the timed loop runs the same forward
    (skip mask) as the KnapSpec draft."""
    config = TINY.replace(num_layers=3)
    params = init_params(config, jax.random.PRNGKey(0))
    profile = latency.profile_latency_forward(config, 2, (32, 96), params=params, warmup=1, repeats=2,
                                              verify_rows=(1, 4), steps_per_call=2, bulk_rows=(8, 32))
    for kind in ("full", "noattn", "nomlp"):
        assert len(profile.forward["samples"][kind]) == 2 and min(profile.forward["times"][kind]) > 0
    assert len(profile.forward["verify_times"]) == 2 and profile.verify_rows == 4
    assert profile.model.c1 >= 0 and profile.model.c0 >= 0 and profile.model.v >= 0 and profile.model.u >= 0
    assert profile.forward["bulk_rows"] == [8, 32] and min(profile.forward["bulk_times"]) > 0
    assert profile.model.p >= 0 and min(profile.forward["plain_samples"]["plain"]) > 0  # the decode loop, timed
    # one loop step == the engine's forward with the same skip mask
    mask = jnp.asarray(latency.forward_skip_masks(3)["noattn"])
    cache = init_cache(config, 2, 32, lengths=jnp.full((2,), 20, jnp.int32))
    tokens = jnp.asarray([[5], [7]], jnp.int32)
    want = jnp.argmax(forward_jit(params, tokens, cache, config=config, skip_mask=mask).logits, axis=-1)
    got, cache = latency.forward_loop(params, cache, tokens, mask, config=config, steps=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(cache.lengths).tolist() == [20, 20]


def test_forward_static_profile_compiles_each_mask_in(tmp_path):
    """``static_masks=True`` ("forward-static"): every profiled mask is compiled into its own loop (no
    conditional left in the program, where the dynamic mask has one per skippable sub-layer), it runs
    the same forward, and the profile keeps its own method on file."""
    from jaxspec.models.llama import freeze_skip_mask

    config = TINY.replace(num_layers=3)
    params = init_params(config, jax.random.PRNGKey(0))
    profile = latency.profile_latency_forward(config, 2, (32, 96), params=params, warmup=1, repeats=2,
                                              verify_rows=(1, 4), steps_per_call=2, bulk_rows=(), static_masks=True)
    assert profile.method == "forward-static" and profile.forward["static_masks"] is True
    assert "compiled in" in profile.forward["how"]
    for kind in ("full", "noattn", "nomlp"):
        assert min(profile.forward["times"][kind]) > 0
    mask = latency.forward_skip_masks(3)["noattn"]
    tokens = jnp.asarray([[5], [7]], jnp.int32)

    def cache():
        return init_cache(config, 2, 32, lengths=jnp.full((2,), 20, jnp.int32))

    static = latency.forward_loop_static.lower(params, cache(), tokens, mask=freeze_skip_mask(mask), config=config,
                                               steps=1).compile().as_text()
    dynamic = latency.forward_loop.lower(params, cache(), tokens, jnp.asarray(mask), config=config,
                                         steps=1).compile().as_text()
    assert "conditional" in dynamic and "conditional" not in static
    want = jnp.argmax(forward_jit(params, tokens, cache(), config=config, skip_mask=jnp.asarray(mask)).logits, axis=-1)
    got, _ = latency.forward_loop_static(params, cache(), tokens, mask=freeze_skip_mask(mask), config=config, steps=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    path = tmp_path / "static.json"
    profile.save(path)
    assert latency.LatencyProfile.load(path) == profile

    def must_not_profile(*args, **kwargs):
        raise AssertionError("profiled although a matching profile was saved")

    assert latency.load_or_profile(path, config, 2, method="forward-static", profile_fn=must_not_profile) == profile
    with pytest.raises(ValueError, match="method 'forward-static', not the requested 'forward'"):
        latency.load_or_profile(path, config, 2, method="forward", profile_fn=must_not_profile)
    assert latency.PROFILERS["forward-static"].keywords == {"static_masks": True}


def test_forward_static_half_profile_times_the_half_masks(tmp_path):
    """``forward-static-half``: the no-Attention / no-MLP forwards skip every second skippable
    sub-layer, compiled in; the profile names those layers and keeps its own method on file."""
    config = TINY.replace(num_layers=6)
    seen = []

    def timer(key, call):  # the real forwards run (their masks are compiled); the clock is synthetic
        seen.append(key[:3])
        jax.block_until_ready(call())
        return key[3] * synthetic_times(TRUE, 6, key[0], key[1], key[2])

    profile = latency.profile_latency_forward(config, 1, (32, 96), warmup=1, repeats=1, verify_rows=(1, 4),
                                              steps_per_call=2, bulk_rows=(), static_masks=True, half_masks=True,
                                              timer=timer)
    assert profile.method == "forward-static-half" and profile.forward["half_masks"] is True
    assert profile.forward["skipped_layers"] == [1, 3] and profile.forward["fit"]["skipped"] == 2
    assert "every second" in profile.forward["how"] and {k for k, _, _ in seen} >= {"noattn", "nomlp"}
    # the synthetic clock skips all S = 4 per mask: read as 2 skipped, each is priced twice as dear
    assert profile.model.c1 == pytest.approx(2 * TRUE.c1, rel=1e-8)
    path = tmp_path / "half.json"
    profile.save(path)
    assert latency.LatencyProfile.load(path) == profile
    assert latency.load_or_profile(path, config, 1, method="forward-static-half",
                                   profile_fn=lambda *a, **k: pytest.fail("profiled again")) == profile
    with pytest.raises(ValueError, match="method 'forward-static-half', not the requested 'forward-static'"):
        latency.load_or_profile(path, config, 1, method="forward-static", profile_fn=lambda *a, **k: None)
    assert latency.PROFILERS["forward-static-half"].keywords == {"static_masks": True, "half_masks": True}


def test_generate_latency_fit_picks_its_own_file(tmp_path, monkeypatch):
    from experiments.knapspec import latency_profiles
    from jaxspec.models import registry

    monkeypatch.setattr(registry, "cache_dir", lambda: tmp_path)
    forward_path = latency_profiles.default_profile_path(TINY, 1, "forward")
    isolated_path = latency_profiles.default_profile_path(TINY, 1, "isolated")
    assert forward_path != isolated_path and forward_path.name.endswith("-forward.json")
    calls = []
    measured, _ = _mock_profile()

    def fake_forward(cfg, b, contexts, params=None, **kwargs):
        calls.append((b, tuple(contexts), params))
        return measured

    monkeypatch.setattr(latency, "profile_latency_forward", fake_forward)
    args = argparse.Namespace(latency_profile=None, latency_fit="forward")
    profile, info = latency_profiles.load_latency(args, TINY, 1, 3000, params="PARAMS")
    assert info["method"] == "forward" and info["measured_now"] and info["path"] == str(forward_path)
    assert calls == [(1, tuple(latency.forward_contexts(3000)), "PARAMS")] and forward_path.exists()
    profile, info = latency_profiles.load_latency(args, TINY, 1, 3000)
    assert not info["measured_now"] and len(calls) == 1  # reused


def test_experiment_latency_fit_forward_on_a_tiny_random_model(tmp_path):
    from experiments.run import main

    out = tmp_path / "ks.json"
    argv = ["knapspec", "--model", "random:smollm2-135m-shape", "--layers", "3", "--contexts", "64",
            "--max-new-tokens", "24", "--gamma-max", "2", "--gamma-buckets", "1", "--batches", "1",
            "--methods", "knapspec", "--candidate-plans", "0", "--plan-cost-repeats", "0", "--device-tag", "test",
            "--latency-fit", "forward", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["config"]["latency_fit"] == "forward"
    lat = data["latency_b1"]
    assert lat["method"] == "forward" and lat["path"].endswith("_b1_forward.json")
    assert set(lat["forward"]["times"]) == {"full", "noattn", "nomlp"}
    case = data["cases"]["test/summarize/ctx64/b1/knapspec"]
    assert case["identical_to_ar"] is True
    pred = case["latency_prediction"]
    assert pred["method"] == "forward" and pred["step_s"] > 0 and pred["decode_s"] > 0
    # plain decoding is priced at the decode loop's own step, p draft-form steps (timed by the profile)
    assert lat["fit"]["p"] > 0 and pred["step_s"] * lat["fit"]["p"] == pytest.approx(case["predicted_ar_step_s"])
    raw = lat["forward"]["fit"]["a_raw"]
    assert lat["fit"]["a"] > 0 and (raw <= 0 or lat["fit"]["a"] == pytest.approx(raw))


def test_a_sub_layer_and_the_per_token_term_never_cost_less_than_nothing():
    """A noisy fit of a tiny model (steps of microseconds) can give ``c3 < 0`` or a falling remainder: the model
    prices such terms at 0, so no plan's draft step, nor its predicted TPT, goes below 0."""
    noisy = latency.LatencyModel(c1=5e-6, c2=4.6e-8, c3=-1.1e-5, c0=0.0, c0_n=-1e-9)
    assert noisy.t_attn(91) == 0.0 and noisy.t_attn(1000) == pytest.approx(4.6e-5 - 1.1e-5)
    assert noisy.t_token(32000) == 0.0 and noisy.t_step(91, 4) == pytest.approx(4 * 5e-6)
    from jaxspec.knapspec.planner import tpt

    draft = 3 * noisy.t_attn(91) + 2 * noisy.t_mlp() + noisy.t_token(91)
    assert draft > 0 and tpt(0.8, 2, draft, noisy.t_step(91, 4), v=0.3, a=0.75) > 0
