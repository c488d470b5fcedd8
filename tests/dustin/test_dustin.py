"""Dustin (docs/methods.md §3): selection vs a numpy reference, signals, ARR, SRH identification, the m sweep and
Algorithm 1, profiles, and sparse verification through the speculative engine (tiny random models)."""

import dataclasses
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.contract import Chunk, ScriptedController
from jaxspec.decoding.policies import SelfDraft, SeparateDraft, parse_skip_spec
from jaxspec.decoding.speculative import EngineConfig, speculative_generate
from jaxspec.dustin import (BudgetError, DraftSignals, DustinConfig, DustinVerify, draft_signal, dustin_policies,
                            select_verify_indices, target_signal)
from jaxspec.dustin.arr import all_heads, round_arr, round_recall_weights
from jaxspec.dustin.selection import reuse_verify_indices
from jaxspec.dustin.signals import _kernel_block, head_scores
from jaxspec.dustin.search import (CalibrationRecords, DustinProfile, ProfileError, algorithm1, best_m,
                                   check_calibration_data, profile_pair, selection_arr, sweep_m)
from jaxspec.dustin.srh import NeedleCase, SRHResult, identify_srh
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward, init_params

TARGET = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
DRAFT = TARGET.replace(num_layers=2, hidden_size=32, intermediate_size=64, head_dim=8)


@pytest.fixture(scope="module")
def models():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2), init_params(DRAFT, jax.random.PRNGKey(5), scale=0.2)


# ---------------------------------------------------------------------------- numpy references
def _top(scores, pool, count):
    """``count`` positions of ``pool`` with the largest scores (ties: lower position)."""
    pool = np.asarray(pool, int)
    order = np.lexsort((pool, -scores[pool]))
    return pool[order[:max(count, 0)]]


def _reference_selection(s_draft, s_target, length, k, sinks, window, m):
    positions = np.arange(length)
    protected = positions[(positions < sinks) | (positions >= length - window)]
    rest = np.setdiff1d(positions, protected)
    budget = k - len(protected)
    from_draft = _top(s_draft, rest, min(m, budget)) if m else np.zeros(0, int)
    rest = np.setdiff1d(rest, from_draft)
    from_target = _top(s_target, rest, budget - len(from_draft))
    chosen = np.sort(np.concatenate([protected, from_draft, from_target]))
    return np.pad(chosen, (0, k - len(chosen)), constant_values=-1)


def _softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


# ---------------------------------------------------------------------------- config
def test_config_defaults_and_errors():
    assert DustinConfig(budget=128).window_size == 32 and DustinConfig(budget=256).window_size == 64
    cfg = DustinConfig(budget=512, draft_layers=(1,), draft_heads=((0, 1),))
    assert cfg.free_budget == 512 - 4 - 64 and cfg.effective_m == cfg.free_budget // 2
    assert cfg.replace(mode="target").effective_m == 0
    assert cfg.replace(mode="draft").effective_m == cfg.free_budget
    for bad in (100, 64, 4096, 512.0, True):
        with pytest.raises(BudgetError, match="not supported"):
            DustinConfig(budget=bad)
    with pytest.raises(ValueError, match="m=999"):
        DustinConfig(budget=512, m=999)
    with pytest.raises(ValueError, match="mode"):
        DustinConfig(mode="both")
    with pytest.raises(ValueError, match="one tuple of query heads per draft layer"):
        DustinConfig(draft_layers=(0, 1), draft_heads=((0,),))
    with pytest.raises(ValueError, match="draft signal"):
        DustinConfig(mode="draft")
    with pytest.raises(ValueError, match="out of range"):
        DustinVerify(DustinConfig(target_layer=5), TARGET)
    assert DustinConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="scoring_layout='rows'; valid"):
        DustinConfig(scoring_layout="rows")
    for layout in ("heads", "pallas"):
        other = cfg.replace(scoring_layout=layout)
        assert other.to_dict()["scoring_layout"] == layout and DustinConfig.from_dict(other.to_dict()) == other
    assert "scoring_layout" not in cfg.to_dict()  # the default stays out of saved profiles


# ---------------------------------------------------------------------------- selection
@pytest.mark.parametrize("k,m", [(128, 0), (128, 40), (128, 92), (256, 0), (256, 17), (256, 188)])
def test_selection_matches_numpy_reference(k, m):
    rng = np.random.RandomState(k + m)
    batch, seq = 7, 700
    s_draft = rng.rand(batch, seq).astype(np.float32)
    s_target = rng.rand(batch, seq).astype(np.float32)
    s_draft[:, ::5] = s_draft[:, 2:3]  # ties
    s_target[1] = np.round(s_target[1], 1)  # heavy ties
    s_target[2] = 0.0
    s_draft[3] = s_target[3]  # both signals agree: the target fill takes the next best
    window = 32 if k == 128 else 64
    lengths = np.array([700, 500, k + 1, k, 40, 3, 4 + window + 5])
    got = np.asarray(select_verify_indices(jnp.asarray(s_draft), jnp.asarray(s_target), jnp.asarray(lengths), k=k,
                                           sinks=4, window=window, m=m))
    for row in range(batch):
        expected = _reference_selection(s_draft[row], s_target[row], lengths[row], k, 4, window, m)
        np.testing.assert_array_equal(got[row], expected, err_msg=f"row {row}")
        chosen = got[row][got[row] >= 0]
        assert (chosen < lengths[row]).all() and len(set(chosen)) == len(chosen)  # never padding, no duplicates
        assert (np.diff(chosen) > 0).all() and (got[row][len(chosen):] == -1).all()  # sorted, -1 only at the end
        if lengths[row] <= k:  # dense
            np.testing.assert_array_equal(chosen, np.arange(lengths[row]))
        else:
            assert len(chosen) == k
            assert set(range(4)) <= set(chosen) and set(range(lengths[row] - window, lengths[row])) <= set(chosen)


def test_selection_budget_beyond_capacity_is_dense():
    scores = jnp.asarray(np.random.RandomState(0).rand(2, 100).astype(np.float32))
    got = np.asarray(select_verify_indices(scores, scores, jnp.array([100, 37]), k=128, sinks=4, window=32, m=10))
    assert got.shape == (2, 128)
    np.testing.assert_array_equal(got[0, :100], np.arange(100))
    np.testing.assert_array_equal(got[1, :37], np.arange(37))
    assert (got[0, 100:] == -1).all() and (got[1, 37:] == -1).all()


# ---------------------------------------------------------------------------- signals
def test_signals_match_bruteforce_gqa():
    rng = np.random.RandomState(1)
    batch, kv_heads, seq, dim, rows = 2, 2, 50, 8, 3
    keys = [rng.randn(batch, kv_heads, seq, dim).astype(np.float32) for _ in range(2)]
    lengths = np.array([50, 21])
    heads, qpk = (0, 3), 2  # head 0 -> KV 0, head 3 -> KV 1

    def reference(q, k, heads):  # q [B, P, R, D]
        out = np.zeros((batch, seq))
        for b in range(batch):
            n = lengths[b]
            for p, h in enumerate(heads):
                s = q[b, p] @ k[b, h // qpk, :n].T / np.sqrt(dim)
                out[b, :n] += _softmax(s).sum(0)
        return out

    q_t = rng.randn(batch, 2, dim).astype(np.float32)
    got = np.asarray(target_signal(jnp.asarray(q_t), jnp.asarray(keys[0]), jnp.asarray(lengths), heads, qpk))
    np.testing.assert_allclose(got, reference(q_t[:, :, None], keys[0], heads), rtol=1e-5, atol=1e-6)
    q_d = rng.randn(batch, 3, rows, dim).astype(np.float32)  # layer a: heads (0, 3); layer b: head (1,)
    signals = DraftSignals(queries=jnp.asarray(q_d), keys=(jnp.asarray(keys[0]), jnp.asarray(keys[1])))
    got = np.asarray(draft_signal(signals, jnp.asarray(lengths), ((0, 3), (1,)), qpk, width=64))
    expected = reference(q_d[:, :2], keys[0], (0, 3)) + reference(q_d[:, 2:], keys[1], (1,))
    assert got.shape == (batch, 64) and (got[:, seq:] == 0).all()
    np.testing.assert_allclose(got[:, :seq], expected, rtol=1e-5, atol=1e-6)
    # one product over every KV head (scoring_layout "heads") gives the same scores; here layer b's head reads
    # only KV head 0, so the packed rows of KV head 1 are padding whose scores must be dropped
    got = np.asarray(target_signal(jnp.asarray(q_t), jnp.asarray(keys[0]), jnp.asarray(lengths), heads, qpk,
                                   "heads"))
    np.testing.assert_allclose(got, reference(q_t[:, :, None], keys[0], heads), rtol=1e-5, atol=1e-6)
    got = np.asarray(draft_signal(signals, jnp.asarray(lengths), ((0, 3), (1,)), qpk, width=64, layout="heads"))
    np.testing.assert_allclose(got[:, :seq], expected, rtol=1e-5, atol=1e-6)
    # uneven groups: three heads in KV 0, one in KV 1 (rows packed to the larger group)
    q_u = rng.randn(batch, 4, rows, dim).astype(np.float32)
    uneven = (0, 1, 1, 2)  # qpk 2: KV 0, 0, 0, 1
    for layout in ("groups", "heads"):
        got = np.asarray(target_signal(jnp.asarray(q_u[:, :, 0]), jnp.asarray(keys[1]), jnp.asarray(lengths),
                                       uneven, qpk, layout))
        np.testing.assert_allclose(got, reference(q_u[:, :, :1], keys[1], uneven), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="layout='rows'"):
        target_signal(jnp.asarray(q_t), jnp.asarray(keys[0]), jnp.asarray(lengths), heads, qpk, "rows")


@pytest.mark.parametrize("seq,rows", [(128, 1), (96, 3), (64, 16), (50, 2)])
def test_signals_pallas_layout_matches_groups(seq, rows):
    """scoring_layout "pallas": the Pallas logits kernel (interpreted off a GPU) reads each used KV head in place and
    gives the "groups" scores, for one probe row per KV head (multiply-reduce), a few (a dot over rows padded to 16)
    and at least 16; a cache whose length is not a multiple of 16 (50) is scored by the groups products."""
    rng = np.random.RandomState(seq)
    batch, kv_heads, dim, qpk = 3, 2, 16, 2
    keys = jnp.asarray(rng.randn(batch, kv_heads, seq, dim).astype(np.float32))
    lengths = jnp.asarray([seq, 37, 5])
    heads = (0, 1) if rows >= 16 else (0, 3)  # both in KV 0 (2 x 16 rows), or one head per KV head
    q = jnp.asarray(rng.randn(batch, 2, rows, dim).astype(np.float32))
    want = np.asarray(head_scores(q, keys, lengths, heads, qpk, "groups"))
    got = np.asarray(head_scores(q, keys, lengths, heads, qpk, "pallas"))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert (got[1, 37:] == 0).all() and (got[2, 5:] == 0).all()
    np.testing.assert_allclose(got.sum(1), len(heads) * rows, rtol=1e-5)  # each (head, row) softmax sums to one
    if seq == 50:  # not a multiple of 16: no Pallas block fits
        assert _kernel_block(seq) == 0
    else:
        assert seq % _kernel_block(seq) == 0


# ---------------------------------------------------------------------------- ARR
def test_arr_full_set_is_one_and_matches_bruteforce(models):
    params, _ = models
    rng = np.random.RandomState(2)
    lengths = np.array([150, 90])
    cache = init_cache(TARGET, 2, 200)
    cache = forward(params, jnp.asarray(rng.randint(0, 128, (2, 150))), cache, config=TARGET).cache
    cache = cache.with_lengths(jnp.asarray(lengths))
    rows = jnp.asarray(rng.randint(0, 128, (2, 5)))
    everything = jnp.asarray(np.stack([np.r_[np.arange(n), -np.ones(150 - n, int)] for n in lengths]))
    np.testing.assert_allclose(np.asarray(round_arr(params, TARGET, rows, cache, everything)), 1.0, rtol=1e-5)
    subset = np.stack([np.r_[np.sort(rng.choice(n, 40, replace=False)), [-1, -1]] for n in lengths])
    got = np.asarray(round_arr(params, TARGET, rows, cache, jnp.asarray(subset)))
    # brute force: every head's attention from its probe query and the keys the forward wrote
    out = forward(params, rows, cache, config=TARGET, probe_heads=all_heads(TARGET))
    queries = np.asarray(out.probes.queries)  # [B, L*H, T, D]
    expected = np.zeros(2)
    for b, n in enumerate(lengths):
        ratios = []
        for p, (layer, head) in enumerate(all_heads(TARGET)):
            keys = np.asarray(out.cache.keys[layer])[b, head // TARGET.queries_per_kv]
            for t in range(5):
                probs = _softmax(queries[b, p, t] @ keys[:n + t + 1].T / np.sqrt(TARGET.head_dim))
                chosen = subset[b][subset[b] >= 0]
                ratios.append(probs[chosen].sum() / probs[:n].sum())
        expected[b] = np.mean(ratios)
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert (got < 1).all()
    weights = np.asarray(round_recall_weights(params, TARGET, rows, cache))
    np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-5)
    assert (weights[1, 90:] == 0).all()


# ---------------------------------------------------------------------------- m sweep and Algorithm 1
def _random_records(seed, items=5, seq=300):
    rng = np.random.RandomState(seed)
    weights = rng.exponential(size=(items, seq)).astype(np.float32) ** 3
    lengths = np.array([300, 250, 200, 120, 161][:items])
    weights[np.arange(seq)[None] >= lengths[:, None]] = 0
    weights /= weights.sum(1, keepdims=True)
    noisy = lambda: (weights + rng.exponential(size=weights.shape) * weights.mean()).astype(np.float32)  # noqa: E731
    return weights, noisy(), noisy(), lengths


def test_sweep_equals_selection_for_every_m():
    weights, s_draft, s_target, lengths = _random_records(0)
    s_target[0, :200:3] = s_target[0, 1]  # ties
    k, sinks, window = 128, 4, 32
    curve = sweep_m(weights, s_draft, s_target, lengths, k=k, sinks=sinks, window=window)
    assert curve.shape == (k - sinks - window + 1,)
    reference = [np.mean([weights[i][[p for p in _reference_selection(s_draft[i], s_target[i], lengths[i], k, sinks,
                                                                       window, m) if p >= 0]].sum()
                          for i in range(len(lengths))]) for m in range(len(curve))]
    np.testing.assert_allclose(curve, reference, rtol=1e-5, atol=1e-6)
    for m in (0, 31, len(curve) - 1):  # and the jitted selection itself
        assert abs(selection_arr(weights, s_draft, s_target, lengths, k=k, sinks=sinks, window=window, m=m)
                   - curve[m]) < 1e-5


def _synthetic_records(items=4, seq=400, a=20, b=50):
    """Weights on a set A (found only by a draft signal) and a set B (found only by the target
    signal); everything else weightless. The ARR surface in m is flat-topped on [a, free - b]."""
    rng = np.random.RandomState(3)
    weights = np.zeros((items, seq), np.float32)
    good_d = np.zeros((items, seq), np.float32)
    good_t = np.zeros((items, seq), np.float32)
    for i in range(items):
        middle = rng.permutation(np.arange(10, seq - 40))
        set_a, set_b = middle[:a], middle[a:a + b]
        weights[i, set_a] = 1.0 + rng.rand(a)
        weights[i, set_b] = 1.0 + rng.rand(b)
        good_d[i] = rng.rand(seq) * 0.1
        good_t[i] = rng.rand(seq) * 0.1
        good_d[i, set_a] = 10 + weights[i, set_a]
        good_t[i, set_b] = 10 + weights[i, set_b]
        good_d[i, set_b] = -1.0  # each signal ranks the other's set last
        good_t[i, set_a] = -1.0
    weights /= weights.sum(1, keepdims=True)
    lengths = np.full(items, seq)
    return weights, good_d, good_t, lengths


def test_sweep_finds_optimum_of_synthetic_surface():
    weights, s_draft, s_target, lengths = _synthetic_records()
    curve = sweep_m(weights, s_draft, s_target, lengths, k=128, sinks=4, window=32)
    m, arr = best_m(curve)
    assert m == 20 and arr == pytest.approx(1.0, abs=1e-5)  # all of A and B fit once m >= |A| = 20
    assert curve[19] < arr and curve[92 - 50] == pytest.approx(arr) and curve[92 - 49] < arr
    assert best_m([0.1, 0.5, 0.3, 0.5]) == (1, 0.5)  # ties: smallest m


def test_algorithm1_on_synthetic_signals():
    weights, good_d, good_t, lengths = _synthetic_records()
    rng = np.random.RandomState(4)
    noise = lambda: rng.rand(*weights.shape).astype(np.float32)  # noqa: E731
    records = CalibrationRecords(
        weights=weights, target_scores=np.stack([noise(), good_t, noise()]),
        draft_scores=np.stack([noise(), good_d, noise() + good_d * 0.01, noise()]), lengths=lengths,
        target_heads=((0, 1), (2, 3), (1, 2)), draft_heads=((0,), (1,), (2,), (3,)), gamma=4)
    result = algorithm1(records, 128, draft_layers=(5, 6, 7, 8))
    cfg = result.config
    assert cfg.target_layer == 1 and cfg.target_heads == (2, 3)
    assert cfg.draft_layers[0] == 6 and cfg.draft_heads[0] == (1,)
    assert cfg.m == 20 and result.arr == pytest.approx(1.0, abs=1e-5)
    assert np.argmax(result.target_layer_arr) == 1
    assert result.steps[0]["added"] and result.steps[-1]["gain"] < 0.001 or len(cfg.draft_layers) == 4
    assert result.arr >= max(result.target_layer_arr)


# ---------------------------------------------------------------------------- profiles
def _profile():
    cfg = DustinConfig(budget=256, m=30, target_layer=1, target_heads=(0, 1, 2, 3), draft_layers=(0,),
                       draft_heads=((1, 2, 3, 0),))
    return DustinProfile(configs={256: cfg, 128: cfg.replace(budget=128, m=10)},
                         target={"name": "tiny-target", "source": "random", "num_layers": 2, "num_heads": 4,
                                 "num_kv_heads": 2},
                         draft={"name": "tiny-draft", "source": "random"}, data={"split": "calibration"},
                         created="2026-01-01T00:00:00+00:00", gamma=4)


def test_profile_round_trip(tmp_path):
    profile = _profile()
    path = tmp_path / "sub" / "profile.json"
    profile.save(path)
    loaded = DustinProfile.load(path)
    assert loaded.configs == profile.configs and loaded.target == profile.target and loaded.created == profile.created
    assert loaded.config(256) == profile.configs[256]
    assert loaded.config(256, mode="target").effective_m == 0
    loaded.check_models(TARGET)
    with pytest.raises(ProfileError, match="num_layers"):
        loaded.check_models(TARGET.replace(num_layers=3))


def test_profile_errors(tmp_path):
    profile = _profile()
    with pytest.raises(BudgetError, match="not supported"):
        profile.config(300)
    with pytest.raises(ProfileError, match="no config for k=512"):
        profile.config(512)
    with pytest.raises(ProfileError, match="does not exist"):
        DustinProfile.load(tmp_path / "missing.json")
    good = profile.to_dict()
    cases = {
        "truncated": json.dumps(good)[:50],
        "not_object": "[1, 2]",
        "kind": json.dumps({**good, "kind": "other"}),
        "format": json.dumps({**good, "format": 99}),
        "missing": json.dumps({k: v for k, v in good.items() if k != "configs"}),
        "budget": json.dumps({**good, "configs": {"300": good["configs"]["256"]}}),
        "budget_key": json.dumps({**good, "configs": {"big": good["configs"]["256"]}}),
        "bad_m": json.dumps({**good, "configs": {"256": {**good["configs"]["256"], "m": 10_000}}}),
        "unknown_field": json.dumps({**good, "configs": {"256": {**good["configs"]["256"], "x": 1}}}),
        "mismatch": json.dumps({**good, "configs": {"512": good["configs"]["256"]}}),
    }
    messages = {"truncated": "not valid JSON", "not_object": "JSON object", "kind": "not a Dustin profile",
                "format": "format 99", "missing": "lacks", "budget": "300 is not supported",
                "budget_key": "not an integer", "bad_m": "m=10000", "unknown_field": "unknown",
                "mismatch": "budget 256"}
    for name, text in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(ProfileError, match=messages[name]):
            DustinProfile.load(path)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ProfileError, match="corrupt"):
        DustinProfile.load(tmp_path / "binary.json")


def test_profile_m_per_length(tmp_path):
    """The per-length m table (docs/methods.md §3.7): held at its ends, linear in log length between calibrated
    lengths, used by ``config(context=...)`` for Dustin-H only, saved and loaded; bad tables and contexts refused."""
    profile = dataclasses.replace(_profile(), m_by_length={256: {2048: 40, 8192: 20}})
    assert [profile.m_at(256, n) for n in (100, 2048, 4096, 8192, 32768)] == [40, 40, 30, 20, 20]
    assert profile.m_at(256, 3000) == round(40 - 20 * np.log(3000 / 2048) / np.log(4))
    assert profile.m_at(128, 4096) == 10  # no table for k=128: the profiled m
    assert profile.config(256, context=4096).m == 30 and profile.config(256).m == 30  # the profiled m is 30 too
    assert profile.config(256, context=8192).m == 20 and profile.config(128, context=8192).m == 10
    assert profile.config(256, mode="target", context=8192).effective_m == 0
    path = tmp_path / "profile.json"
    profile.save(path)
    assert DustinProfile.load(path).m_by_length == {256: {2048: 40, 8192: 20}}
    assert "m_by_length" not in _profile().to_dict()  # absent unless recalibrated: older profiles load unchanged
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ProfileError, match="context="):
            profile.m_at(256, bad)
    good = profile.to_dict()
    free = profile.configs[256].free_budget
    cases = {"not an integer": {"big": {"2048": 3}}, "no config": {"512": {"2048": 3}},
             "must map context": {"256": {}}, "0..k - s - w": {"256": {"2048": free + 1}},
             "lengths must": {"256": {"0": 3}}}
    for message, table in cases.items():
        with pytest.raises(ProfileError, match=message):
            DustinProfile.from_dict({**good, "m_by_length": table})


def test_m_at_length_is_step_c_of_algorithm1():
    """m_at_length with a config's layers kept equals the best m of an exhaustive search with the jitted
    selection, and reports the ARR at the config's own m; a config without draft layers is refused."""
    from jaxspec.dustin.search import m_at_length

    weights, good_d, good_t, lengths = _synthetic_records()
    rng = np.random.RandomState(9)
    records = CalibrationRecords(weights=weights, target_scores=np.stack([rng.rand(*weights.shape), good_t]),
                                 draft_scores=np.stack([good_d * 0.5, rng.rand(*weights.shape), good_d * 0.5]),
                                 lengths=lengths, target_heads=((0,), (1,)), draft_heads=((0,), (1,), (2,)), gamma=4)
    cfg = DustinConfig(budget=128, sinks=4, window=32, m=60, target_layer=1, target_heads=(1,), draft_layers=(3, 7),
                       draft_heads=((0,), (2,)))
    found = m_at_length(records, cfg, draft_rows=[0, 2])
    s_d = records.draft_scores[[0, 2]].sum(axis=0)
    # the jitted sweep's curve against the exact selection: all 93 m would cost ~90 s of eager selections, so
    # every 4th m, the ends, the profile's m and the best m with its neighbours
    ms = sorted(set(range(0, 93, 4)) | {1, 19, 20, 21, 60, 92})
    brute = {m: selection_arr(weights, s_d, good_t, lengths, k=128, sinks=4, window=32, m=m) for m in ms}
    curve = np.asarray(found["m_curve"])
    assert found["rounds"] == 4 and len(curve) == 93
    np.testing.assert_allclose([curve[m] for m in ms], [brute[m] for m in ms], atol=1e-5)
    assert found["m"] == int(np.argmax(np.round(curve, 5))) == 20 and found["arr"] == pytest.approx(brute[20], abs=1e-5)
    assert brute[20] >= max(brute.values()) - 1e-6
    assert found["arr_at_profile_m"] == pytest.approx(brute[60], abs=1e-5) and found["profile_m"] == 60
    with pytest.raises(ValueError, match="no draft layer"):
        m_at_length(records, cfg.replace(draft_layers=(), draft_heads=(), m=None), draft_rows=[])


# ---------------------------------------------------------------------------- SRH identification
def test_srh_identification(models):
    params, _ = models
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 128, n).tolist() for n in (60, 45)]
    probe = [NeedleCase(tokens=tuple(p), needle_span=(0, 1), answer_ids=(999,)) for p in prompts + prompts[1:]]
    continuation = identify_srh(params, TARGET, probe, max_new_tokens=6, batch_size=2).generated  # greedy outputs
    cases = [NeedleCase(tokens=tuple(prompts[0]), needle_span=(10, 20), answer_ids=tuple(continuation[0][:3])),
             NeedleCase(tokens=tuple(prompts[1]), needle_span=(30, 34), answer_ids=tuple(continuation[1][:2])),
             NeedleCase(tokens=tuple(prompts[1]), needle_span=(5, 9), answer_ids=(999, 998))]  # never emitted
    result = identify_srh(params, TARGET, cases, max_new_tokens=6, batch_size=2)
    assert result.kept.tolist() == [True, True, False] and result.recall[2] == 0.0
    assert result.generated == continuation
    # brute force: attention on the needle span at the steps that emit an answer token
    expected = np.zeros((TARGET.num_layers, TARGET.num_heads))
    sequences = np.zeros((2, 65), np.int32)
    for row, (case, emitted) in enumerate(zip(cases[:2], result.generated[:2])):
        sequence = list(case.tokens) + emitted[:-1]
        sequences[row, :len(sequence)] = sequence
    out = forward(params, jnp.asarray(sequences), init_cache(TARGET, 2, 80), config=TARGET,
                   probe_heads=all_heads(TARGET))
    for row, (case, emitted) in enumerate(zip(cases[:2], result.generated[:2])):
        queries = np.asarray(out.probes.queries)[row]
        for i, token in enumerate(emitted):
            if token not in case.answer_ids:
                continue
            pos = len(case.tokens) - 1 + i
            for p, (layer, head) in enumerate(all_heads(TARGET)):
                keys = np.asarray(out.cache.keys[layer])[row, head // TARGET.queries_per_kv, :pos + 1]
                probs = _softmax(queries[p, pos] @ keys.T / np.sqrt(TARGET.head_dim))
                expected[layer, head] += probs[slice(*case.needle_span)].sum()
    np.testing.assert_allclose(result.scores, expected, rtol=1e-4, atol=1e-6)
    top = result.top_heads(2)
    assert len(top) == TARGET.num_layers and all(len(h) == 2 for h in top)
    assert all(expected[layer, list(h)].min() >= np.delete(expected[layer], list(h)).max()
               for layer, h in enumerate(top))
    with pytest.raises(ValueError, match="recall threshold"):
        dataclasses.replace(result, kept=np.zeros(3, bool)).top_heads()


def test_grouped_top_heads_match_brute_force():
    """GQA-aware SRHs (docs/methods.md §3.4): the heads from at most G KV groups with the largest summed
    needle mass, against every head subset of the right size; G = all groups is the unconstrained choice."""
    import itertools

    rng = np.random.RandomState(3)
    qpk, num_heads = 3, 12  # 4 KV groups of 3 query heads
    scores = rng.rand(6, num_heads)
    scores[5] = np.round(scores[5] * 4) / 4  # ties
    result = SRHResult(scores=scores, recall=np.ones(1), kept=np.ones(1, bool), counted_steps=np.ones(1),
                       generated=[[0]], case_ids=["c"])
    for per_layer, groups in ((4, 2), (3, 1), (2, 1), (4, 3), (5, 2)):
        chosen = result.top_heads(per_layer, kv_groups=groups, queries_per_kv=qpk)
        for layer, heads in enumerate(chosen):
            row = scores[layer]
            assert len(set(h // qpk for h in heads)) <= groups and len(set(heads)) == per_layer
            best = max(row[list(c)].sum() for c in itertools.combinations(range(num_heads), per_layer)
                       if len({h // qpk for h in c}) <= groups)
            assert row[list(heads)].sum() == pytest.approx(best)
            assert list(row[list(heads)]) == sorted(row[list(heads)], reverse=True)  # by descending mass
    assert result.top_heads(4, kv_groups=4, queries_per_kv=qpk) == result.top_heads(4)
    for kwargs, message in ((dict(kv_groups=0), "kv_groups=0: valid 1..4"),
                            (dict(kv_groups=5), "kv_groups=5: valid 1..4"),
                            (dict(kv_groups=1), "4 SRHs per layer do not fit in kv_groups=1")):
        with pytest.raises(ValueError, match=message):
            result.top_heads(4, queries_per_kv=qpk, **kwargs)


# ---------------------------------------------------------------------------- engine
PROMPTS = [np.random.RandomState(7).randint(0, 128, n).tolist() for n in (220, 150, 40)]


@pytest.fixture(scope="module")
def dense_run(models):
    target_params, draft_params = models
    engine = EngineConfig(gamma=3, max_new_tokens=16)
    classic = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=SeparateDraft(DRAFT),
                                   draft_params=draft_params, engine=engine)
    ar = generate(target_params, TARGET, PROMPTS, 16).rows()
    assert classic.rows() == ar
    return engine, classic.rows()


def _dustin_config(budget, mode="hybrid", m=None):
    return DustinConfig(budget=budget, m=m, target_layer=1, target_heads=(0, 1, 2, 3), draft_layers=(0, 1),
                        draft_heads=((0, 1, 2, 3), (1, 3)), mode=mode)


def test_dustin_budget_beyond_context_equals_dense(models, dense_run):
    target_params, draft_params = models
    engine, dense_rows = dense_run
    draft, verify = dustin_policies(_dustin_config(512, m=100), TARGET, DRAFT)
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                  verify_policy=verify, engine=engine)
    assert result.rows() == dense_rows  # k >= context: exactly dense verification (and AR)
    # the verify state holds the target SRH queries of the last token in the target cache
    state = result.final_state
    in_cache = np.asarray(state.committed) - 1
    sequences = np.zeros((3, in_cache.max()), np.int32)  # right-padded: padding never precedes a real token
    for row, prompt in enumerate(PROMPTS):
        sequences[row, :in_cache[row]] = (prompt + result.rows()[row])[:in_cache[row]]
    fresh = forward(target_params, jnp.asarray(sequences), init_cache(TARGET, 3, 256), config=TARGET,
                     probe_heads=verify.probe_heads)
    expected = np.asarray(fresh.probes.queries)[np.arange(3), :, in_cache - 1]
    np.testing.assert_allclose(np.asarray(state.verify_state["query"]), expected, rtol=1e-4, atol=1e-4)


def test_dustin_sparse_end_to_end(models, dense_run):
    target_params, draft_params = models
    engine, dense_rows = dense_run
    draft, verify = dustin_policies(_dustin_config(128, m=30), TARGET, DRAFT)
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                  verify_policy=verify, engine=engine)
    rows = result.rows()
    assert [len(r) for r in rows] == [16, 16, 16] and all(0 <= t < 128 for r in rows for t in r)
    assert rows[2] == dense_rows[2]  # a 40-token prompt stays within k = 128: dense
    assert result.metrics["rounds"] > 0
    # scoring every KV head in one product selects the same positions: the same tokens (float32, greedy)
    # and so does the Pallas scoring kernel reading each used KV head in place (interpreted on the CPU)
    for layout in ("heads", "pallas"):
        draft_h, verify_h = dustin_policies(_dustin_config(128, m=30).replace(scoring_layout=layout), TARGET, DRAFT)
        assert speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft_h, draft_params=draft_params,
                                    verify_policy=verify_h, engine=engine).rows() == rows, layout
    # the same round's indices through the policy API: k positions, sinks and window included
    cache = init_cache(TARGET, 1, 256)
    cache = forward(target_params, jnp.asarray([PROMPTS[0]]), cache, config=TARGET).cache
    state = verify.prefill(target_params, cache, np.asarray([PROMPTS[0]]), np.array([220]))
    signals = DraftSignals(queries=jnp.ones((1, 6, 3, DRAFT.head_dim)),
                           keys=(jnp.ones((1, 2, 256, DRAFT.head_dim)),) * 2)
    indices = np.asarray(verify.verify_indices(state, cache.with_lengths(jnp.array([219])), jnp.array([220]),
                                               signals))[0]
    assert len(set(indices)) == 128 and {0, 1, 2, 3} <= set(indices) and set(range(219 - 32, 219)) <= set(indices)
    # the ablations through the same API: Dustin-T ignores the draft, Dustin-D the target query
    for mode, ignored in (("target", dict(signals=None)), ("draft", dict(state={}))):
        ablation = DustinVerify(_dustin_config(128, mode=mode), TARGET, DRAFT)
        args = dict(state=state, target_cache=cache.with_lengths(jnp.array([219])), committed=jnp.array([220]),
                    signals=signals) | ignored
        chosen = np.asarray(ablation.verify_indices(**args))[0]
        assert len(set(chosen)) == 128 and (chosen >= 0).all()
    assert DustinVerify(_dustin_config(128, mode="draft"), TARGET, DRAFT).probe_heads == ()


def test_dustin_target_only_and_self_draft(models, dense_run):
    target_params, _ = models
    engine, dense_rows = dense_run
    verify = DustinVerify(_dustin_config(128, mode="target"), TARGET)
    assert verify.probe_heads == ((1, 0), (1, 1), (1, 2), (1, 3))
    skip = parse_skip_spec("mlp:1", 2)
    # Dustin-T with a plain self-draft (no signals needed) and Dustin-H with the Dustin self-draft
    policy = SelfDraft(TARGET)
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=policy,
                                  draft_state=policy.initial_state(skip), verify_policy=verify, engine=engine)
    assert [len(r) for r in result.rows()] == [16, 16, 16] and result.rows()[2] == dense_rows[2]
    draft, hybrid = dustin_policies(_dustin_config(512, m=60).replace(draft_heads=((0, 1), (2,))), TARGET)
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft,
                                  draft_state=draft.initial_state(skip), verify_policy=hybrid, engine=engine)
    assert result.rows() == dense_rows
    with pytest.raises(TypeError, match="draft lookahead signal"):
        speculative_generate(target_params, TARGET, PROMPTS[2:], draft_policy=policy,
                             draft_state=policy.initial_state(skip),
                             verify_policy=DustinVerify(_dustin_config(128), TARGET), engine=engine)


@pytest.mark.parametrize("draft_kv", ["full", "verify-set"])
def test_dustin_finished_rows_skipped_change_no_token(models, dense_run, draft_kv):
    """Sparse Dustin (k = 128 < the long prompts) with a row that stops early: marking finished rows
    frozen (their attention reads one history slot) leaves every row's tokens as the loop that runs
    them in full decodes them, for a full-KV and a sparse-KV draft."""
    target_params, draft_params = models
    draft, verify = dustin_policies(_dustin_config(128, m=30).replace(draft_kv=draft_kv), TARGET, DRAFT)

    def run(**engine):
        return speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                    verify_policy=verify, engine=EngineConfig(gamma=3, max_new_tokens=16, **engine))

    free = run().rows()
    stop = next(t for t in free[1][1:] if t not in free[0])  # ends row 1 early, row 0 runs to the end
    rows = {skip: run(stop_tokens=(stop,), skip_finished_rows=skip).rows() for skip in (True, False)}
    assert rows[True] == rows[False]
    assert len(rows[True][1]) < 16 and len(rows[True][0]) == 16


# ---------------------------------------------------------------------------- profiling pipeline
class CharTokenizer:
    """One token per ASCII character (vocabulary 128)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _documents(count=4, paragraphs=80):
    words = "river meadow lantern harbour willow granite orchard velvet ember thistle cobalt saffron".split()
    rng = random.Random(0)
    return ["\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + f" d{d}p{p}."
                        for p in range(paragraphs)) for d in range(count)]


def test_profile_pipeline_calibration_split(models, tmp_path):
    from jaxspec.data import build_splits

    target_params, draft_params = models
    calibration, evaluation = build_splits(CharTokenizer(), _documents(), kinds=("passkey",), context_lengths=(400,),
                                           depths=(0.3, 0.7))
    with pytest.raises(ValueError, match="calibration split"):
        check_calibration_data(list(evaluation))
    profile, records = profile_pair(target_params, TARGET, draft_params, DRAFT, calibration, CharTokenizer(),
                                    budgets=(128, 256), evaluation=evaluation, target_name="tiny-target",
                                    target_source="random", draft_name="tiny-draft", draft_source="random",
                                    gamma=3, max_new_tokens=6, recall_threshold=-1.0, srh_max_new_tokens=4)
    assert records.num_items > 0 and records.target_scores.shape[0] == TARGET.num_layers
    np.testing.assert_allclose(records.weights.sum(1), 1.0, rtol=1e-4)
    assert profile.data["split"] == "calibration" and profile.data["disjoint_from_evaluation_checked"]
    assert profile.target["name"] == "tiny-target" and profile.created
    for budget in (128, 256):
        cfg = profile.config(budget)
        search = profile.search[str(budget)]
        # the recorded ARR is the ARR of the chosen config's exact selection on the calibration records
        s_draft = records.draft_scores[list(cfg.draft_layers)].sum(0) if cfg.draft_layers else None
        arr = selection_arr(records.weights, s_draft, records.target_scores[cfg.target_layer], records.lengths,
                            k=budget, sinks=cfg.sinks, window=cfg.window_size, m=cfg.effective_m)
        assert arr == pytest.approx(search["arr"], abs=1e-5)
        assert search["arr"] >= max(search["target_layer_arr"]) - 1e-9
    path = tmp_path / "profile.json"
    profile.save(path)
    assert DustinProfile.load(path).configs == profile.configs


def test_profile_pipeline_grouped_srhs(models):
    from jaxspec.data import build_splits

    target_params, draft_params = models
    calibration, evaluation = build_splits(CharTokenizer(), _documents(), kinds=("passkey",), context_lengths=(400,),
                                           depths=(0.3,))
    with pytest.raises(ValueError, match="4 SRHs per layer do not fit in kv_groups=1"):  # before any forward
        profile_pair(None, TARGET, None, DRAFT, [], CharTokenizer(), srh_kv_groups=1)
    profile, _ = profile_pair(target_params, TARGET, draft_params, DRAFT, calibration, CharTokenizer(), budgets=(128,),
                              evaluation=evaluation, gamma=3, max_new_tokens=4, recall_threshold=-1.0,
                              srh_max_new_tokens=3, heads_per_layer=2, srh_kv_groups=1)
    assert profile.srh["kv_groups"] == 1
    for model, key in ((TARGET, "target"), (DRAFT, "draft")):
        assert all(len({h // model.queries_per_kv for h in heads}) == 1 for heads in profile.srh[key]["top_heads"])
    cfg = profile.config(128)
    assert len({h // TARGET.queries_per_kv for h in cfg.target_heads}) == 1


# ---------------------------------------------------------------------------- input-aware m (docs/methods.md §3.7)
def test_m_rule_config():
    cfg = _dustin_config(128, m=70)  # free = 92
    assert cfg.m_rule == "fixed" and not cfg.input_aware and "m_rule" not in cfg.to_dict()
    aware = cfg.replace(m_rule="coverage")
    assert aware.m_candidates == (70, 61, 79) and aware.input_aware  # 70 -/+ round(0.1 * 92)
    assert DustinConfig.from_dict(aware.to_dict()) == aware
    assert cfg.replace(m=0, m_rule="coverage", m_spread=0.25).m_candidates == (0, 23)  # clipped at 0
    # m = k - s - w (Dustin-D's split): coverage can still move m down (so it needs s_T); max-mass cannot
    at_free = cfg.replace(m=92, m_rule="coverage")
    assert at_free.input_aware and at_free.m_candidates == (92, 83) and at_free.uses_target_signal
    assert not cfg.replace(m=92, m_rule="max-mass").input_aware and not cfg.replace(m=92).uses_target_signal
    # a wider ladder: m first, then m -/+ i steps (i = 1 .. m_steps), clipped, duplicates dropped
    ladder = cfg.replace(m_rule="coverage", m_steps=3)
    assert ladder.m_candidates == (70, 61, 79, 52, 88, 43, 92) and DustinConfig.from_dict(ladder.to_dict()) == ladder
    assert ladder.to_dict()["m_steps"] == 3 and "m_steps" not in aware.to_dict()
    for bad, message in ((dict(m_rule="adaptive"), "m_rule='adaptive'"), (dict(m_spread=0.0), "m_spread=0.0"),
                         (dict(m_rule="coverage", mode="target"), "needs mode='hybrid'"),
                         (dict(m_rule="coverage", m_steps=0), "m_steps=0"),
                         (dict(m_rule="entropy", m_steps=2), "m_steps=2 widens the coverage rule's")):
        with pytest.raises(ValueError, match=message):
            cfg.replace(**bad)


def test_per_row_m_and_input_aware_selection():
    from jaxspec.dustin.selection import select_input_aware, select_verify_indices_rows, signal_mass

    rng = np.random.RandomState(3)
    batch, seq, k, sinks, window = 4, 600, 128, 4, 32
    s_d = jnp.asarray(rng.rand(batch, seq).astype(np.float32) ** 4)
    s_t = jnp.asarray(np.round(rng.rand(batch, seq), 2).astype(np.float32))  # ties
    lengths = jnp.asarray([600, 333, 100, 129])
    ms = np.array([0, 17, 92, 50])
    rows = np.asarray(select_verify_indices_rows(s_d, s_t, lengths, jnp.asarray(ms), k=k, sinks=sinks, window=window))
    for b in range(batch):  # row by row the fixed rule with that row's m
        fixed = select_verify_indices(s_d[b:b + 1], s_t[b:b + 1], lengths[b:b + 1], k=k, sinks=sinks, window=window,
                                      m=int(ms[b]))
        np.testing.assert_array_equal(rows[b], np.asarray(fixed)[0])
    candidates = (50, 27, 73)
    chosen, m = select_input_aware(s_d, s_t, lengths, k=k, sinks=sinks, window=window, candidates=candidates)
    chosen, m = np.asarray(chosen), np.asarray(m)
    mass = np.asarray(signal_mass(s_d, lengths, sinks=sinks, window=window)
                      + signal_mass(s_t, lengths, sinks=sinks, window=window))
    for b in range(batch):
        cover = {}
        for c in candidates:
            idx = np.asarray(select_verify_indices(s_d[b:b + 1], s_t[b:b + 1], lengths[b:b + 1], k=k, sinks=sinks,
                                                   window=window, m=c))[0]
            cover[c] = mass[b, idx[idx >= 0]].sum()
            if c == m[b]:
                np.testing.assert_array_equal(chosen[b], idx)
        assert cover[int(m[b])] >= max(cover.values()) - 1e-6
        if int(lengths[b]) <= k:  # the whole history fits: dense whatever m
            assert set(chosen[b][chosen[b] >= 0]) == set(range(int(lengths[b])))
    assert m[0] != 50 or m[1] != 50  # random signals: the rule does move m somewhere


@pytest.mark.parametrize("scoring", ["radix", "sort"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_input_aware_selection_equals_its_direct_reference(seed, scoring):
    """The two-selection coverage rule, its candidates scored either way (radix thresholds and a merge, or one
    sort per list), picks the same m and the same I_verify as selecting every candidate in full, on rows with
    ties, short rows (history inside sinks + window, or below k), and candidates at 0 and at k - s - w."""
    from jaxspec.dustin.selection import select_input_aware, select_input_aware_reference

    rng = np.random.RandomState(seed)
    batch, seq, k, sinks, window = 6, 700, 128, 4, 32
    free = k - sinks - window
    s_d = rng.rand(batch, seq).astype(np.float32) ** 3
    s_t = np.round(rng.rand(batch, seq), 2).astype(np.float32)  # many ties
    s_d[1] = np.round(s_d[1], 1)  # ties in the draft signal too
    lengths = jnp.asarray([700, 30, 90, 150, 36, 513])
    for candidates in ((50, 27, 73), (0, free, 40), (free,), (0,), (50, 41, 59, 32, 68, 23, 77)):
        fast, m_fast = select_input_aware(jnp.asarray(s_d), jnp.asarray(s_t), lengths, k=k, sinks=sinks,
                                          window=window, candidates=candidates, scoring=scoring)
        ref, m_ref = select_input_aware_reference(jnp.asarray(s_d), jnp.asarray(s_t), lengths, k=k, sinks=sinks,
                                                  window=window, candidates=candidates)
        np.testing.assert_array_equal(np.asarray(m_fast), np.asarray(m_ref))
        np.testing.assert_array_equal(np.asarray(fast), np.asarray(ref))
    # a budget wider than the cache (the signals are padded to k)
    short_d, short_t, short_len = jnp.asarray(s_d[:, :100]), jnp.asarray(s_t[:, :100]), jnp.minimum(lengths, 100)
    fast, m_fast = select_input_aware(short_d, short_t, short_len, k=k, sinks=sinks, window=window,
                                      candidates=(50, 27, 73), scoring=scoring)
    ref, m_ref = select_input_aware_reference(short_d, short_t, short_len, k=k, sinks=sinks, window=window,
                                              candidates=(50, 27, 73))
    np.testing.assert_array_equal(np.asarray(m_fast), np.asarray(m_ref))
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(ref))
    with pytest.raises(ValueError, match="candidates"):
        select_input_aware(jnp.asarray(s_d), jnp.asarray(s_t), lengths, k=k, sinks=sinks, window=window,
                           candidates=(free + 1,), scoring=scoring)
    with pytest.raises(ValueError, match="scoring='bogus'"):
        select_input_aware(jnp.asarray(s_d), jnp.asarray(s_t), lengths, k=k, sinks=sinks, window=window,
                           candidates=(50,), scoring="bogus")


def test_input_aware_m_through_the_engine(models, dense_run):
    """k >= context with the coverage rule: exactly dense (== AR); k = 128: sparse, runs, one k-set per row."""
    target_params, draft_params = models
    engine, dense_rows = dense_run
    for steps in (1, 3):  # the default candidates and a wider ladder (m_steps)
        cfg = _dustin_config(512, m=100).replace(m_rule="coverage", m_steps=steps)
        draft, verify = dustin_policies(cfg, TARGET, DRAFT)
        result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                      verify_policy=verify, engine=engine)
        assert result.rows() == dense_rows
    draft, verify = dustin_policies(_dustin_config(128, m=30).replace(m_rule="coverage"), TARGET, DRAFT)
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                  verify_policy=verify, engine=engine)
    rows = result.rows()
    assert [len(r) for r in rows] == [16, 16, 16] and rows[2] == dense_rows[2]  # 40-token prompt: dense


def test_max_mass_selection_is_a_hybrid_split():
    """max-mass's set equals the fixed rule's set at the split m it reports (a top set of s_D plus the
    best of s_T); a history within k is dense."""
    from jaxspec.dustin.selection import max_mass_split, select_max_mass

    rng = np.random.RandomState(4)
    batch, seq, k, sinks, window = 3, 500, 128, 4, 32
    s_d = jnp.asarray(rng.rand(batch, seq).astype(np.float32) ** 6)
    s_t = jnp.asarray(rng.rand(batch, seq).astype(np.float32) ** 3)
    lengths = jnp.asarray([500, 300, 120])
    for balance in (0.25, 1.0, 4.0):
        chosen = select_max_mass(s_d, s_t, lengths, k=k, sinks=sinks, window=window, balance=balance)
        ms = np.asarray(max_mass_split(s_d, s_t, lengths, chosen, sinks=sinks, window=window, balance=balance))
        for b in range(batch):
            fixed = select_verify_indices(s_d[b:b + 1], s_t[b:b + 1], lengths[b:b + 1], k=k, sinks=sinks,
                                          window=window, m=int(ms[b]))
            if int(lengths[b]) > k:
                np.testing.assert_array_equal(np.asarray(chosen)[b], np.asarray(fixed)[0])
                assert 0 <= ms[b] <= k - sinks - window
            else:
                assert set(np.asarray(chosen)[b][np.asarray(chosen)[b] >= 0]) == set(range(int(lengths[b])))
    cfg = _dustin_config(128, m=23).replace(m_rule="max-mass")
    assert cfg.m_balance == (92 - 23) / 23 and cfg.input_aware


def test_entropy_rule_config():
    """The entropy rule (docs/methods.md §3.7): candidates m, m -/+ step; in force only for 0 < m < k - s - w;
    its dead zone round-trips through to_dict and bad values give one-line errors."""
    from jaxspec.dustin.selection import entropy_rule_args

    cfg = _dustin_config(128, m=70).replace(m_rule="entropy")  # free = 92, step = round(0.1 * 92) = 9
    assert cfg.input_aware and cfg.m_candidates == (70, 61, 79) and cfg.uses_target_signal
    assert entropy_rule_args(cfg) == dict(k=128, sinks=4, window=32, m=70, step=9, centre=-0.2, band=0.05)
    assert DustinConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["m_entropy_band"] == 0.05
    assert "m_entropy_centre" not in _dustin_config(128, m=70).to_dict()
    # Dustin-D's split (m = k - s - w) stays fixed: one signal, one selection
    assert not cfg.replace(m=92).input_aware and not cfg.replace(m=92).uses_target_signal
    assert not cfg.replace(m=0).input_aware
    for bad, message in ((dict(m_entropy_band=-0.1), "m_entropy_band=-0.1 must be >= 0"),
                         (dict(m_entropy_centre=2.0), r"m_entropy_centre=2.0 must be a number in \[-1, 1\]"),
                         (dict(m_entropy_band=True), "m_entropy_band=True"),
                         (dict(mode="draft"), "needs mode='hybrid'")):
        with pytest.raises(ValueError, match=message):
            cfg.replace(**bad)


def test_entropy_gated_selection():
    """Per row: the entropy gap H(p_T) - H(p_D) of the normalised signals picks m - step, m or m + step, and
    the set is the fixed rule's at that m; a history within k is dense; a wide dead zone is the fixed rule."""
    from jaxspec.dustin.selection import select_entropy_gated, signal_entropy_gap, signal_mass

    rng = np.random.RandomState(5)
    batch, seq, k, sinks, window, m, step = 4, 600, 128, 4, 32, 50, 9
    sharp, flat = rng.rand(seq).astype(np.float32) ** 12, rng.rand(seq).astype(np.float32) + 0.5
    # rows: target sharp / draft flat (m down), target flat / draft sharp (m up), both alike, short history
    s_d = jnp.asarray(np.stack([flat, sharp, flat, sharp]))
    s_t = jnp.asarray(np.stack([sharp, flat, flat * 1.01, flat]))
    lengths = jnp.asarray([600, 500, 400, 100])
    gap = np.asarray(signal_entropy_gap(s_d, s_t, lengths, sinks=sinks, window=window))
    for b in range(batch):  # against a direct numpy entropy of each normalised signal
        count = int(lengths[b]) - sinks - window
        h = []
        for s in (s_t, s_d):
            p = np.asarray(signal_mass(s, lengths, sinks=sinks, window=window))[b]
            h.append(-(p[p > 0] * np.log(p[p > 0])).sum() / np.log(count) if count > 1 else 0.0)
        assert gap[b] == pytest.approx(h[0] - h[1], abs=1e-5)
    chosen, ms = select_entropy_gated(s_d, s_t, lengths, k=k, sinks=sinks, window=window, m=m, step=step,
                                      centre=0.0, band=0.05)
    chosen, ms = np.asarray(chosen), np.asarray(ms)
    assert list(ms[:3]) == [m - step, m + step, m]
    for b in range(batch):
        fixed = np.asarray(select_verify_indices(s_d[b:b + 1], s_t[b:b + 1], lengths[b:b + 1], k=k, sinks=sinks,
                                                 window=window, m=int(ms[b])))[0]
        np.testing.assert_array_equal(chosen[b], fixed)
    assert set(chosen[3][chosen[3] >= 0]) == set(range(100))  # 100 <= k: dense whatever m
    wide, ms = select_entropy_gated(s_d, s_t, lengths, k=k, sinks=sinks, window=window, m=m, step=step, centre=0.0,
                                    band=1.0)
    assert list(np.asarray(ms)) == [m] * batch
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(select_verify_indices(s_d, s_t, lengths, k=k,
                                                                                     sinks=sinks, window=window, m=m)))


def test_entropy_rule_through_the_engine(models, dense_run):
    """k >= context with the entropy rule: exactly dense (greedy == AR); k = 128: sparse, runs."""
    target_params, draft_params = models
    engine, dense_rows = dense_run
    for budget, m in ((512, 100), (128, 30)):
        draft, verify = dustin_policies(_dustin_config(budget, m=m).replace(m_rule="entropy"), TARGET, DRAFT)
        result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                      verify_policy=verify, engine=engine)
        rows = result.rows()
        if budget == 512:
            assert rows == dense_rows
        else:
            assert [len(r) for r in rows] == [16, 16, 16] and rows[2] == dense_rows[2]  # 40-token prompt: dense


# ---------------------------------------------------------------------------- reusing a selection (§3.8)
def test_reselect_every_config():
    assert DustinConfig().reselect_every == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="reselect_every="):
            DustinConfig(reselect_every=bad)


def test_reused_selection_keeps_the_chosen_positions_and_moves_the_window():
    rng = np.random.RandomState(3)
    k, sinks, window, m = 128, 4, 32, 40
    for selected, now in ((300, 300), (300, 305), (1000, 1004)):
        s_draft, s_target = rng.rand(selected), rng.rand(selected)
        previous = _reference_selection(s_draft, s_target, selected, k, sinks, window, m)
        got = np.asarray(reuse_verify_indices(jnp.asarray(previous[None]), jnp.asarray([selected]), jnp.asarray([now]),
                                              sinks=sinks, window=window))[0]
        chosen = previous[(previous >= sinks) & (previous < selected - window)]
        want = np.sort(np.concatenate([np.arange(sinks), chosen, np.arange(now - window, now)]))
        np.testing.assert_array_equal(got, want)
        assert len(set(got.tolist())) == k and (np.diff(got) > 0).all()
        if now == selected:  # no new token: the same set as the selection it reuses
            np.testing.assert_array_equal(got, previous)


def test_reselect_every_through_the_engine(models, dense_run):
    """k >= context: every round selects (dense; greedy == AR); k = 128: the rounds in between reuse the last
    selection, rows that fit in k stay dense, and the state counts rounds since the last selection."""
    target_params, draft_params = models
    engine, dense_rows = dense_run
    for budget, m in ((512, 100), (128, 30)):
        draft, verify = dustin_policies(_dustin_config(budget, m=m).replace(reselect_every=3), TARGET, DRAFT)
        result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                      verify_policy=verify, engine=engine)
        rows = result.rows()
        reuse = result.final_state.verify_state["reuse"]
        if budget == 512:
            assert rows == dense_rows and int(reuse["since"]) == 1  # histories fit in k: always selected
        else:
            assert [len(r) for r in rows] == [16, 16, 16] and rows[2] == dense_rows[2]  # 40-token prompt: dense
            indices = np.asarray(reuse["indices"])
            assert 1 <= int(reuse["since"]) <= 3
            for row in (0, 1):  # the long prompts: a full selection of k distinct positions, sinks included
                assert len(set(indices[row].tolist())) == 128 and {0, 1, 2, 3} <= set(indices[row].tolist())


def test_a_reuse_round_computes_no_selection(models):
    """Between selections ``verify_forward`` verifies on the reused set (``fresh`` False) and the next
    R-th round selects again."""
    target_params, _ = models
    verify = DustinVerify(_dustin_config(128, m=30).replace(reselect_every=2), TARGET, DRAFT)
    cache = forward(target_params, jnp.asarray([PROMPTS[0]]), init_cache(TARGET, 1, 256), config=TARGET).cache
    state = verify.prefill(target_params, cache, np.asarray([PROMPTS[0]]), np.array([220]))
    signals = DraftSignals(queries=jnp.ones((1, 6, 3, DRAFT.head_dim)),
                           keys=(jnp.ones((1, 2, 256, DRAFT.head_dim)),) * 2)
    rows = jnp.asarray([[5, 6, 7]], jnp.int32)
    first = verify.verify_forward(target_params, rows, cache.with_lengths(jnp.array([200])), jnp.array([201]),
                                  signals, config=TARGET, state=state).probes
    assert bool(first.fresh) and int(first.selected[0]) == 200
    state = verify.update(state, first, jnp.array([2]), jnp.array([203]))
    assert int(state["reuse"]["since"]) == 1
    second = verify.verify_forward(target_params, rows, cache.with_lengths(jnp.array([202])), jnp.array([203]),
                                   signals, config=TARGET, state=state).probes
    assert not bool(second.fresh)
    want = reuse_verify_indices(first.indices, jnp.array([200]), jnp.array([202]), sinks=4, window=32)
    np.testing.assert_array_equal(np.asarray(second.indices), np.asarray(want))
    state = verify.update(state, second, jnp.array([2]), jnp.array([205]))
    assert int(state["reuse"]["since"]) == 2
    third = verify.verify_forward(target_params, rows, cache.with_lengths(jnp.array([204])), jnp.array([205]),
                                  signals, config=TARGET, state=state).probes
    assert bool(third.fresh)


def test_m_choice_study_bounds_on_repeated_rounds():
    """m_choice_study (docs/methods.md §3.7) on sequences whose rounds repeat exactly, with s_T equal to
    the recall weights: the previous round's best m is this round's (persistence reaches the oracle from
    the second round on, 2/3 of the gap over 3 rounds), the next round's s_T picks the oracle m (all but
    the last round), and the hindsight rule picks the best of m and m -/+ one step from the second round."""
    from jaxspec.dustin.search import m_choice_study

    rng = np.random.RandomState(7)
    seq, rounds, k, sinks, window, m0 = 300, 3, 128, 4, 32, 46
    cfg = DustinConfig(budget=k, sinks=sinks, window=window, m=m0, target_layer=0, target_heads=(0,),
                       draft_layers=(0,), draft_heads=((0,),))
    expected = {name: [] for name in ("fixed", "oracle", "persistence", "signal_proxy", "hindsight")}
    w_all, t_all, d_all, ids, seq_curves = [], [], [], [], []
    for sequence in range(2):
        w = rng.gamma(0.3, size=seq).astype(np.float32)
        w /= w.sum()
        d = (w + rng.rand(seq) * 0.02).astype(np.float32)  # a noisy copy: the draft signal alone is not the best
        t = (w * 5 + rng.rand(seq) * 0.01).astype(np.float32)
        true = t / t.sum()  # the recall weights: the target signal stands for them exactly
        curve = sweep_m(true[None], d[None], t[None], np.array([seq]), k=k, sinks=sinks, window=window)
        seq_curves.append(np.asarray(curve))
        best = int(np.argmax(curve))
        cands = cfg.m_candidates
        hind = m0 if max(curve[m] for m in cands) - curve[m0] <= 1e-6 else cands[int(np.argmax([curve[m] for m in cands]))]
        for r in range(rounds):
            w_all.append(true), t_all.append(t), d_all.append(d), ids.append(sequence)
            expected["fixed"].append(curve[m0])
            expected["oracle"].append(curve[best])
            expected["persistence"].append(curve[m0] if r == 0 else curve[best])
            expected["signal_proxy"].append(curve[best] if r < rounds - 1 else curve[m0])
            expected["hindsight"].append(curve[m0] if r == 0 else curve[hind])
    records = CalibrationRecords(weights=np.stack(w_all), target_scores=np.stack(t_all)[None],
                                 draft_scores=np.stack(d_all)[None], lengths=np.full(len(ids), seq),
                                 target_heads=((0,),), draft_heads=((0,),), gamma=4, sequence=np.array(ids))
    study = m_choice_study(records, cfg)
    assert study["rounds"] == 6 and study["sequences"] == 2
    for name, values in expected.items():
        assert study["arr"][name] == pytest.approx(np.mean(values), abs=1e-6), name
    assert study["arr"]["oracle"] > study["arr"]["fixed"]  # the instance has a gap to close
    assert study["gap_closed"]["persistence"] == pytest.approx(2 / 3, abs=1e-4)
    assert study["gap_closed"]["signal_proxy"] == pytest.approx(2 / 3, abs=1e-4)
    # one m for all rounds: the best of the mean curve; cross-validated: each sequence scored at the other's best m
    c0, c1 = seq_curves
    m_all = int(np.argmax((c0 + c1) / 2))
    assert study["best_fixed_m"] == {"all": m_all, "folds": [int(np.argmax(c0)), int(np.argmax(c1))]}
    assert study["arr"]["best_fixed"] == pytest.approx((c0[m_all] + c1[m_all]) / 2, abs=1e-6)
    assert study["arr"]["best_fixed_crossval"] == pytest.approx((c1[np.argmax(c0)] + c0[np.argmax(c1)]) / 2, abs=1e-6)
    assert study["arr"]["fixed"] <= study["arr"]["best_fixed"] <= study["arr"]["oracle"]
    # the coverage rule on each round's signals, as it decides online: against its direct reference, each round's
    # ARR at the m it picks among m and m -/+ one step (the profile's m; the other sequence's best single m)
    from jaxspec.dustin.selection import select_input_aware_reference

    def rule_arr(center, rows):
        cands = dataclasses.replace(cfg, m=int(center)).m_candidates
        _, chosen = select_input_aware_reference(np.stack(d_all)[rows], np.stack(t_all)[rows], np.full(len(rows), seq),
                                                 k=k, sinks=sinks, window=window, candidates=tuple(cands))
        return [seq_curves[ids[r]][int(m)] for r, m in zip(rows, np.asarray(chosen))]

    rows = np.arange(len(ids))
    assert study["arr"]["coverage"] == pytest.approx(np.mean(rule_arr(m0, rows)), abs=1e-6)
    crossval = rule_arr(np.argmax(c1), rows[:3]) + rule_arr(np.argmax(c0), rows[3:])
    assert study["arr"]["coverage_crossval"] == pytest.approx(np.mean(crossval), abs=1e-6)
    # a per-length m (the profile's m at this length): that m every round, and the coverage rule around it
    m_len = m0 + 20
    study = m_choice_study(records, cfg, length_m=m_len)
    assert study["length_m"] == m_len
    assert study["arr"]["length_m"] == pytest.approx((c0[m_len] + c1[m_len]) / 2, abs=1e-6)
    assert study["arr"]["coverage_length_m"] == pytest.approx(np.mean(rule_arr(m_len, rows)), abs=1e-6)
    assert study["gap_closed"]["length_m"] == pytest.approx(
        (study["arr"]["length_m"] - study["arr"]["fixed"]) / (study["arr"]["oracle"] - study["arr"]["fixed"]))
    assert "length_m" not in m_choice_study(records, cfg)["gap_closed"]
    with pytest.raises(ValueError, match="length_m=999"):
        m_choice_study(records, cfg, length_m=999)
    with pytest.raises(ValueError, match="sequence ids"):
        m_choice_study(dataclasses.replace(records, sequence=None), cfg)


def test_m_choice_study_holds_the_coverage_rules_m_between_its_decisions():
    """coverage_held3 (docs/methods.md §3.7): the coverage rule decides in rounds 0 and 3 of each sequence and each
    round between is scored at the m of the last deciding round, on rounds whose signals all differ."""
    from jaxspec.dustin.search import m_choice_study
    from jaxspec.dustin.selection import select_input_aware_reference

    rng = np.random.RandomState(11)
    seq, rounds, k, sinks, window, m0 = 300, 5, 128, 4, 32, 46
    cfg = DustinConfig(budget=k, sinks=sinks, window=window, m=m0, target_layer=0, target_heads=(0,),
                       draft_layers=(0,), draft_heads=((0,),))
    w_all, t_all, d_all, ids, curves = [], [], [], [], []
    for sequence in range(2):
        for _ in range(rounds):
            w = rng.gamma(0.3, size=seq).astype(np.float32)
            w /= w.sum()
            d = (w + rng.rand(seq) * 0.05).astype(np.float32)
            t = (w * 5 + rng.rand(seq) * 0.2).astype(np.float32)
            w_all.append(w), t_all.append(t), d_all.append(d), ids.append(sequence)
            curves.append(np.asarray(sweep_m(w[None], d[None], t[None], np.array([seq]), k=k, sinks=sinks,
                                             window=window)))
    records = CalibrationRecords(weights=np.stack(w_all), target_scores=np.stack(t_all)[None],
                                 draft_scores=np.stack(d_all)[None], lengths=np.full(len(ids), seq),
                                 target_heads=((0,),), draft_heads=((0,),), gamma=4, sequence=np.array(ids))
    _, chosen = select_input_aware_reference(np.stack(d_all), np.stack(t_all), np.full(len(ids), seq), k=k,
                                             sinks=sinks, window=window, candidates=tuple(cfg.m_candidates))
    chosen = np.asarray(chosen)
    deciding = [0, 0, 0, 3, 3, 5, 5, 5, 8, 8]  # rounds 0 and 3 of each 5-round sequence decide
    assert len(set(chosen.tolist())) > 1  # the rule moves m between rounds here, so holding it matters
    study = m_choice_study(records, cfg)
    assert study["arr"]["coverage"] == pytest.approx(np.mean([c[m] for c, m in zip(curves, chosen)]), abs=1e-6)
    held = np.mean([curves[j][chosen[deciding[j]]] for j in range(len(ids))])
    assert study["arr"]["coverage_held3"] == pytest.approx(held, abs=1e-6)
    assert "coverage_held3" in study["gap_closed"] and "coverage_length_m_held3" not in study["gap_closed"]
    with_length = m_choice_study(records, cfg, length_m=m0 + 10, hold=(2,))
    assert "coverage_length_m_held2" in with_length["arr"] and "coverage_held3" not in with_length["arr"]
    with pytest.raises(ValueError, match="hold=\\[1\\]"):
        m_choice_study(records, cfg, hold=(1,))


# ---------------------------------------------------------------------------- the coverage rule's m held (§3.7)
def test_m_every_config():
    cfg = _dustin_config(128, m=30).replace(m_rule="coverage", m_every=3)
    assert cfg.to_dict()["m_every"] == 3 and DustinConfig.from_dict(cfg.to_dict()) == cfg
    assert "m_every" not in cfg.replace(m_every=1).to_dict()
    for bad, message in ((dict(m_every=0), "m_every=0"), (dict(m_every=True), "m_every=True"),
                         (dict(m_every=2, m_rule="max-mass"), "m_every=2 holds the coverage rule's m")):
        with pytest.raises(ValueError, match=message):
            cfg.replace(**bad)


def test_m_every_schedule_config():
    cfg = _dustin_config(128, m=30).replace(m_rule="coverage", m_every=3, m_every_schedule="unrolled")
    assert cfg.to_dict()["m_every_schedule"] == "unrolled" and DustinConfig.from_dict(cfg.to_dict()) == cfg
    assert "m_every_schedule" not in cfg.replace(m_every_schedule="cond").to_dict()  # the default
    with pytest.raises(ValueError, match="m_every_schedule='loop'; valid: \\('cond', 'unrolled'\\)"):
        cfg.replace(m_every_schedule="loop")


def test_scheduled_selection_equals_the_conditional_one():
    """select_scheduled (the decision fixed when compiled) selects what select_held's lax.cond selects, in a
    deciding and in a holding round, and carries no conditional."""
    from jaxspec.dustin.selection import select_held, select_scheduled

    rng = np.random.RandomState(9)
    cfg = _dustin_config(128, m=46).replace(m_rule="coverage", m_every=3)
    lengths = jnp.asarray([600, 550, 100], jnp.int32)
    s_d, s_t = (jnp.asarray(rng.rand(3, 600).astype(np.float32) ** p) for p in (8, 3))
    m_rows = jnp.asarray([20, 46, 72], jnp.int32)
    for decide in (True, False):
        got = select_scheduled(cfg, s_d, s_t, lengths, m_rows, decide=decide)
        want = select_held(cfg, s_d, s_t, lengths, m_rows, jnp.bool_(decide))
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        text = select_scheduled.lower(cfg, s_d, s_t, lengths, m_rows, decide=decide).as_text()
        assert "stablehlo.case" not in text and "stablehlo.if" not in text
    assert "stablehlo.case" in select_held.lower(cfg, s_d, s_t, lengths, m_rows, jnp.bool_(True)).as_text()


def test_held_m_selects_as_the_fixed_rule_with_the_rules_last_m():
    """A deciding round is the coverage rule's own selection; a round between selects with the m it chose (the
    fixed rule per row) on that round's own signals, short rows dense."""
    from jaxspec.dustin.selection import select_held, select_input_aware, select_verify_indices_rows

    rng = np.random.RandomState(5)
    cfg = _dustin_config(128, m=46).replace(m_rule="coverage", m_every=3)
    lengths = jnp.asarray([600, 550, 100], jnp.int32)
    s_d, s_t = (jnp.asarray(rng.rand(3, 600).astype(np.float32) ** p) for p in (8, 3))
    start = jnp.full((3,), cfg.effective_m, jnp.int32)
    indices, m = select_held(cfg, s_d, s_t, lengths, start, jnp.bool_(True))
    want, want_m = select_input_aware(s_d, s_t, lengths, k=128, sinks=cfg.sinks, window=cfg.window_size,
                                      candidates=cfg.m_candidates)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(m), np.asarray(want_m))
    s_d2, s_t2 = (jnp.asarray(rng.rand(3, 600).astype(np.float32) ** p) for p in (8, 3))  # the next round
    held, m2 = select_held(cfg, s_d2, s_t2, lengths, m, jnp.bool_(False))
    np.testing.assert_array_equal(np.asarray(m2), np.asarray(m))
    rows = select_verify_indices_rows(s_d2, s_t2, lengths, m, k=128, sinks=cfg.sinks, window=cfg.window_size)
    np.testing.assert_array_equal(np.asarray(held), np.asarray(rows))


def test_m_every_through_the_engine(models, dense_run):
    """k >= context: dense whatever m (greedy == AR); k = 128: the rule decides in every third round, the state
    holds each row's m in between and counts the rounds."""
    target_params, draft_params = models
    engine, dense_rows = dense_run
    for budget, m in ((512, 100), (128, 30)):
        cfg = _dustin_config(budget, m=m).replace(m_rule="coverage", m_every=3)
        draft, verify = dustin_policies(cfg, TARGET, DRAFT)
        result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                      verify_policy=verify, engine=engine)
        rows = result.rows()
        hold = result.final_state.verify_state["m_hold"]
        assert int(hold["since"]) >= 1 and set(np.asarray(hold["m"]).tolist()) <= set(cfg.m_candidates)
        if budget == 512:
            assert rows == dense_rows
        else:
            assert [len(r) for r in rows] == [16, 16, 16] and rows[2] == dense_rows[2]  # 40-token prompt: dense
    # one round body with the lax.cond (the default) and the loop unrolled over each cycle of m_every rounds:
    # the same tokens, rounds and held m, run to the end or in chunks of rounds that split the cycles
    class Chunks(ScriptedController):
        def chunks(self, run):
            while not run.finished():
                yield Chunk(rounds=5)  # a cycle, then a round of the next: the next chunk aligns first

    cfg = _dustin_config(128, m=30).replace(m_rule="coverage", m_every=3)
    runs = {}
    for schedule in ("unrolled", "cond"):
        for controller in (None, Chunks()):
            draft, verify = dustin_policies(cfg.replace(m_every_schedule=schedule), TARGET, DRAFT)
            assert verify.round_period == (3 if schedule == "unrolled" else 1)
            result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft,
                                          draft_params=draft_params, verify_policy=verify, engine=engine,
                                          controller=controller)
            hold = result.final_state.verify_state["m_hold"]
            runs[schedule, controller is None] = (result.rows(), result.metrics["rounds"],
                                                  np.asarray(hold["m"]).tolist(), int(hold["since"]))
    assert len(set(map(repr, runs.values()))) == 1, runs
    # with reused selections too (reselect_every): a reusing round decides nothing and keeps each row's m
    cfg = _dustin_config(128, m=30).replace(m_rule="coverage", m_every=3, reselect_every=2)
    draft, verify = dustin_policies(cfg, TARGET, DRAFT)
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, draft_params=draft_params,
                                  verify_policy=verify, engine=engine)
    assert [len(r) for r in result.rows()] == [16, 16, 16]
    assert set(np.asarray(result.final_state.verify_state["m_hold"]["m"]).tolist()) <= set(cfg.m_candidates)
