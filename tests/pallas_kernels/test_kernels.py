"""Pallas kernels vs their jnp references (interpret mode on CPU; compiled on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.dustin.selection import select_top_k
from jaxspec.dustin.signals import srh_scores
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit, init_params
from pallas_kernels.attention import dense_history_partials, sparse_attention_fused, sparse_history_partials
from pallas_kernels.reference import (NEG_INF, clean_indices, dense_history_reference, merge_partials, normalize,
                                      sparse_history_reference)
from pallas_kernels.selection import srh_scores_pallas

from tests.conftest import check_partials, kernel_inputs, relative_norm_error  # noqa: E402

INTERPRET = jax.default_backend() != "gpu"


def _rel(a, b):
    return relative_norm_error(a, b)


def _inputs(seed, **kwargs):
    return kernel_inputs(seed, **{"seq": 320, **kwargs})


def _check(partial, reference, tol):
    check_partials(partial, reference, tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_k,splits", [(32, 3), (64, 2), (16, 7)])
def test_dense_kernel_matches_reference(dtype, tol, block_k, splits):
    """Ragged lengths (one empty row, lengths not divisible by the block), >= 3 blocks."""
    q, k, v = _inputs(block_k + splits, dtype=dtype)
    lengths = jnp.array([0, 100, 317], jnp.int32)
    partials = dense_history_partials(q, k, v, lengths, block_k=block_k, num_splits=splits, interpret=INTERPRET)
    assert partials[0].shape[2] >= 2
    _check(merge_partials(partials, axis=2), dense_history_reference(q, k, v, lengths), tol)


def test_dense_kernel_splits_many_query_rows_into_blocks():
    """A prefill chunk's packed rows (more than one program holds) run block by block, same result."""
    q, k, v = _inputs(3, rows=64)
    lengths = jnp.array([5, 130, 320], jnp.int32)
    split = dense_history_partials(q, k, v, lengths, block_k=32, num_splits=2, max_rows=16, interpret=INTERPRET)
    whole = dense_history_partials(q, k, v, lengths, block_k=32, num_splits=2, interpret=INTERPRET)
    assert split[0].shape == whole[0].shape
    _check(merge_partials(split, axis=2), dense_history_reference(q, k, v, lengths), 1e-5)
    with pytest.raises(ValueError, match="max_rows"):
        dense_history_partials(q, k, v, lengths, max_rows=24, interpret=INTERPRET)


def test_dense_kernel_rejects_bad_shapes():
    q, k, v = _inputs(0, rows=16)
    with pytest.raises(ValueError, match="multiple of block_k"):
        dense_history_partials(q, k[:, :, :300], v[:, :, :300], jnp.array([1, 2, 3]), block_k=64,
                               interpret=INTERPRET)
    with pytest.raises(ValueError, match="power of two"):
        dense_history_partials(q[:, :, :12], k, v, jnp.array([1, 2, 3]), interpret=INTERPRET)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_sparse_kernel_matches_reference_with_padding_and_duplicates(dtype, tol):
    q, k, v = _inputs(7, dtype=dtype)
    lengths = jnp.array([0, 100, 317], jnp.int32)
    rng = np.random.RandomState(1)
    raw = rng.randint(-5, 330, (3, 128)).astype(np.int32)
    raw[1, 5] = raw[1, 4]  # duplicate
    raw[2, :40] = 7  # many duplicates
    raw[2, 100:] = -1  # padding
    indices = clean_indices(jnp.asarray(raw), lengths)
    assert (np.asarray(indices)[0] == -1).all()  # an empty history selects nothing
    partials = sparse_history_partials(q, k, v, indices, chunk=32, interpret=INTERPRET)
    reference = sparse_history_reference(q, k, v, indices)
    _check(merge_partials(partials, axis=2), reference, tol)
    # the cleaned set equals the deduplicated valid set: compare against the dense reference on it
    row = 2
    chosen = sorted(set(int(i) for i in raw[row] if 0 <= i < 317))
    mask_len = jnp.zeros((3,), jnp.int32)
    dense_on_subset = sparse_history_reference(q, k, v, jnp.asarray(
        [[-1] * 128, [-1] * 128, chosen + [-1] * (128 - len(chosen))], jnp.int32))
    assert _rel(normalize(reference)[row], normalize(dense_on_subset)[row]) < 1e-6
    del mask_len


@pytest.mark.parametrize("chunk,per_program", [(32, 2), (16, 4), (32, 4)])
def test_sparse_kernel_multi_chunk_programs(chunk, per_program):
    """Programs that walk several chunks (online softmax across them) equal the reference,
    also when whole chunks are padding."""
    q, k, v = _inputs(11, seq=448)
    lengths = jnp.array([448, 90, 5], jnp.int32)
    rng = np.random.RandomState(per_program)
    raw = rng.randint(0, 448, (3, 256)).astype(np.int32)
    raw[1, 64:] = -1  # a row whose later chunks are all padding
    indices = clean_indices(jnp.asarray(raw), lengths)
    partials = sparse_history_partials(q, k, v, indices, chunk=chunk, chunks_per_program=per_program,
                                       interpret=INTERPRET)
    assert partials[0].shape[2] == 256 // (chunk * per_program)
    _check(merge_partials(partials, axis=2), sparse_history_reference(q, k, v, indices), 1e-5)
    with pytest.raises(ValueError, match="must divide"):
        sparse_history_partials(q, k, v, indices, chunk=32, chunks_per_program=3, interpret=INTERPRET)


def test_partials_merge_exactly():
    """History split in two disjoint parts merges to the whole (the sink/window/top-k/new merge)."""
    q, k, v = _inputs(3)
    lengths = jnp.array([320, 320, 320], jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(320, dtype=jnp.int32), (3, 320))
    first = sparse_history_partials(q, k, v, jnp.where(idx < 100, idx, -1), chunk=64, interpret=INTERPRET)
    second = sparse_history_partials(q, k, v, jnp.where(idx >= 100, idx, -1), chunk=64, interpret=INTERPRET)
    merged = merge_partials([merge_partials(first, axis=2), merge_partials(second, axis=2)])
    assert _rel(normalize(merged), normalize(dense_history_reference(q, k, v, lengths))) < 1e-5


def _top_k_reference(scores, lengths, k, sinks, window):
    out = []
    for row, length in zip(scores, lengths):
        pos = np.arange(len(row))
        valid = pos < length
        protected = valid & ((pos < sinks) | (pos >= length - window))
        candidates = np.nonzero(valid & ~protected)[0]
        order = np.lexsort((candidates, -row[candidates]))[: max(k - protected.sum(), 0)]
        chosen = np.sort(np.concatenate([np.nonzero(protected)[0], candidates[order]]))
        out.append(np.pad(chosen, (0, k - len(chosen)), constant_values=-1))
    return np.array(out)


@pytest.mark.parametrize("bits,histogram", [(8, "scatter"), (8, "compare"), (4, "compare"), (16, "scatter"),
                                            (4, "pallas"), (None, None)])
@pytest.mark.parametrize("k,sinks,window", [(128, 4, 32), (64, 0, 0), (256, 4, 64)])
def test_selection_equals_exact_top_k(k, sinks, window, bits, histogram):
    rng = np.random.RandomState(k)
    scores = rng.randn(5, 1000).astype(np.float32)
    scores[:, ::7] = scores[:, 3:4]  # ties across positions
    scores[1] = np.round(scores[1], 1)  # heavy ties
    scores[4] = 0.0  # all equal
    lengths = np.array([1000, 513, 60, 3, 700])
    got = np.asarray(select_top_k(jnp.asarray(scores), jnp.asarray(lengths), k=k, sinks=sinks, window=window,
                                  bits=bits, histogram=histogram))
    expected = _top_k_reference(scores, lengths, k, sinks, window)
    np.testing.assert_array_equal(got, expected)
    assert ((got < lengths[:, None]) | (got == -1)).all()  # never padding
    short = lengths <= k
    for row in np.nonzero(short)[0]:  # fewer valid positions than k: dense
        assert sorted(got[row][got[row] >= 0]) == list(range(lengths[row]))


def test_default_radix_counts_long_rows_by_compare_on_a_gpu(monkeypatch):
    """Without bits / histogram the radix select takes the 8-bit scatter-add, except on a GPU from
    COMPARE_RADIX_FROM positions: the 4-bit compare histogram (faster there, the same set)."""
    from jaxspec.dustin import selection

    assert selection.default_radix(selection.COMPARE_RADIX_FROM) == (8, "scatter")  # this machine: the CPU
    monkeypatch.setattr(selection.jax, "default_backend", lambda: "gpu")
    assert selection.default_radix(selection.COMPARE_RADIX_FROM) == (4, "compare")
    assert selection.default_radix(selection.COMPARE_RADIX_FROM - 1) == (8, "scatter")
    keys = selection.order_preserving_keys(jnp.asarray(np.random.RandomState(0).randn(2, 64), jnp.float32))
    alive, need = jnp.ones((2, 64), bool), jnp.array([5, 17])
    for bits, histogram in ((None, None), (4, "compare"), (8, "scatter"), (16, None)):
        got = selection.radix_threshold(keys, alive, need, bits=bits, histogram=histogram)
        expected = selection.radix_threshold(keys, alive, need, bits=8, histogram="scatter")
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected[0]))


def test_selection_errors():
    with pytest.raises(ValueError, match="exceed the budget"):
        select_top_k(jnp.zeros((1, 100)), jnp.array([50]), k=16, sinks=8, window=16)
    with pytest.raises(ValueError, match="larger than the cache"):
        select_top_k(jnp.zeros((1, 100)), jnp.array([50]), k=128)
    with pytest.raises(ValueError, match="must divide 32"):
        select_top_k(jnp.zeros((1, 100)), jnp.array([50]), k=16, bits=5)
    with pytest.raises(ValueError, match="histogram method"):
        select_top_k(jnp.zeros((1, 100)), jnp.array([50]), k=16, histogram="sort")


def test_srh_scores_sum_softmax_mass():
    q, k, _ = _inputs(5, kv_heads=2, rows=16)
    queries = q[:, :, :4].reshape(3, 4, 2, 32)  # 4 heads x 2 rows
    lengths = jnp.array([10, 200, 320])
    groups = (0, 0, 1, 1)
    scores = np.asarray(srh_scores(queries, k, lengths, groups))
    np.testing.assert_allclose(scores.sum(axis=1), 8.0, rtol=1e-5)  # 4 heads x 2 rows, each sums to 1
    assert (scores[0, 10:] == 0).all()
    expected = np.zeros((3, 320))
    for h, g in enumerate(groups):
        s = np.einsum("brd,bsd->brs", np.asarray(queries[:, h]), np.asarray(k[:, g]))
        s = np.where(np.arange(320)[None, None] < np.asarray(lengths)[:, None, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        expected += (p / p.sum(-1, keepdims=True)).sum(1)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=6,
                         num_kv_heads=2, head_dim=16, dtype="float32")
    return config, init_params(config, jax.random.PRNGKey(0), scale=0.2)


@pytest.mark.parametrize("sparse", [False, True])
def test_model_pallas_backend_matches_xla(tiny, sparse):
    config, params = tiny
    pallas = config.replace(attention_backend="pallas" if not INTERPRET else "pallas-interpret")
    rng = np.random.RandomState(0)
    prompt = jnp.asarray(rng.randint(0, 97, (3, 70)))
    lengths = jnp.array([70, 33, 5])
    results = []
    for cfg in (config, pallas):
        cache = init_cache(cfg, 3, 128)
        cache = forward_jit(params, prompt, cache, config=cfg).cache.with_lengths(lengths)
        rows = jnp.asarray(rng.randint(0, 97, (3, 5)))
        indices = jnp.asarray(np.random.RandomState(1).randint(-3, 80, (3, 40))) if sparse else None
        results.append(forward_jit(params, jnp.asarray(np.random.RandomState(2).randint(0, 97, (3, 5))), cache,
                               config=cfg, verify_indices=indices, probe_heads=((1, 4),)))
    assert _rel(results[1].logits, results[0].logits) < 1e-5
    probs_x = np.asarray(results[0].probes.history_probs)
    probs_p = np.asarray(results[1].probes.history_probs)[..., : probs_x.shape[-1]]
    np.testing.assert_allclose(probs_p, probs_x, atol=1e-6)


def test_pallas_backend_refuses_cpu_without_interpret(tiny):
    config, params = tiny
    if not INTERPRET:
        pytest.skip("on a GPU the compiled backend is valid")
    cache = init_cache(config, 1, 64)
    with pytest.raises(ValueError, match="needs a GPU"):
        forward_jit(params, jnp.zeros((1, 2), jnp.int32), cache, config=config.replace(attention_backend="pallas"))
    assert NEG_INF < -1e29


@pytest.mark.parametrize("groups,rows", [((0, 1, 0, 1), 1), ((1, 1, 1, 1), 1), ((0, 0, 1, 1), 3), ((0, 0, 0, 1), 8)])
def test_srh_scores_pallas_matches_xla(groups, rows):
    """The Pallas scoring kernel (multiply-reduce for one row per KV group; a tensor-core dot for more, the rows
    zero-padded to 16 and only the real ones stored: 4 and 8 rows here, and 32) equals the XLA scoring, with ragged
    lengths not divisible by the block."""
    keys = jax.random.split(jax.random.PRNGKey(rows), 2)
    k = jax.random.normal(keys[0], (3, 2, 384, 32))
    queries = 0.3 * jax.random.normal(keys[1], (3, 4, rows, 32))
    lengths = jnp.array([384, 200, 7])
    expected = np.asarray(srh_scores(queries, k, lengths, groups))
    got = np.asarray(srh_scores_pallas(queries, k, lengths, groups, block_s=128, interpret=INTERPRET))
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6)
    assert (got[2, 7:] == 0).all() and (got[1, 200:] == 0).all()  # padding gets no mass
    padded = np.asarray(srh_scores_pallas(queries, k, lengths, groups, block_s=128, interpret=INTERPRET,
                                          store_padding=True))  # all 16 dot rows stored, no in-kernel split
    np.testing.assert_allclose(padded, expected, rtol=2e-4, atol=1e-6)
    with pytest.raises(ValueError, match="kv_groups"):
        srh_scores_pallas(queries, k, lengths, (0, 1, 2, 0), interpret=INTERPRET)


def test_sparse_attention_fused_equals_partials_plus_new_tokens():
    """One-launch sparse verification == sparse partials merged with the causal new-token part."""
    from pallas_kernels.reference import partial_from_scores

    steps, groups = 3, 4
    q, k, v = _inputs(13, batch=2, kv_heads=2, rows=16, dim=32, seq=320)
    q = q.at[:, :, groups * steps:].set(0.0)
    keys = jax.random.split(jax.random.PRNGKey(14), 2)
    k_new = jax.random.normal(keys[0], (2, 2, steps, 32))
    v_new = jax.random.normal(keys[1], (2, 2, steps, 32))
    lengths = jnp.array([320, 150], jnp.int32)
    raw = np.random.RandomState(3).randint(0, 320, (2, 128)).astype(np.int32)
    raw[1, 50:] = -1
    indices = clean_indices(jnp.asarray(raw), lengths)
    history = merge_partials(sparse_history_partials(q, k, v, indices, chunk=32, interpret=INTERPRET), axis=2)
    scores = jnp.einsum("bhmd,bhud->bhmu", q, k_new)
    causal = (jnp.arange(steps)[None, :] <= (jnp.arange(16) % steps)[:, None])[None, None]
    new_part = partial_from_scores(scores, causal, v_new)
    expected = normalize(merge_partials([history, new_part]))
    got = sparse_attention_fused(q, k, v, indices, k_new, v_new, steps=steps, chunk=32, interpret=INTERPRET)
    used = groups * steps
    assert _rel(got[:, :, :used], expected[:, :, :used]) < 1e-5
    with pytest.raises(ValueError, match="steps"):
        sparse_attention_fused(q, k, v, indices, k_new, v_new, steps=2, chunk=32, interpret=INTERPRET)
