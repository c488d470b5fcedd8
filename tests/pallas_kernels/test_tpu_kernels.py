"""Mosaic TPU kernels vs their jnp references, in JAX's TPU interpret mode on CPU
(``pltpu.InterpretParams``: memory spaces, DMAs, semaphores and scalar prefetch simulated), and
the ``pallas-tpu-interpret`` backend end to end (greedy speculative decoding, Dustin) against
``xla``. On a TPU the same file runs the kernels compiled (``pallas-tpu``). The same under
shard_map on 8 host devices is in tests/parallel/test_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.policies import SeparateDraft
from jaxspec.decoding.speculative import EngineConfig, speculative_generate
from jaxspec.dustin import DustinConfig, dustin_policies
from jaxspec.dustin.signals import srh_scores
from jaxspec.models import attention
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit, init_params
from pallas_kernels.reference import clean_indices, dense_history_reference, merge_partials, sparse_history_reference
from pallas_kernels.tpu_attention import tpu_dense_history_partials, tpu_sparse_history_partials
from pallas_kernels.tpu_selection import tpu_srh_scores

from tests.conftest import check_partials, kernel_inputs, relative_norm_error  # noqa: E402

INTERPRET = jax.default_backend() != "tpu"


def _rel(a, b):
    return relative_norm_error(a, b)


def _inputs(seed, **kwargs):
    return kernel_inputs(seed, **{"seq": 384, **kwargs})


def _check(partial, reference, tol):
    check_partials(partial, reference, tol, with_empty_row=True)


@pytest.mark.parametrize("dtype,tol,block_k,splits", [(jnp.float32, 1e-5, 128, 1), (jnp.float32, 1e-5, 32, 4),
                                                       (jnp.bfloat16, 2e-2, 128, 2)])
def test_tpu_dense_kernel_matches_reference(dtype, tol, block_k, splits):
    """Ragged lengths (an empty row; lengths not divisible by the block), >= 3 blocks, splits."""
    q, k, v = _inputs(block_k + splits, dtype=dtype)
    lengths = jnp.array([0, 100, 317], jnp.int32)
    partials = tpu_dense_history_partials(q, k, v, lengths, block_k=block_k, num_splits=splits,
                                          interpret=INTERPRET)
    assert partials[0].shape[2] == splits and 384 // block_k >= 3
    _check(merge_partials(partials, axis=2), dense_history_reference(q, k, v, lengths), tol)


def test_tpu_dense_kernel_splits_many_query_rows_and_rejects_bad_shapes():
    """More query rows than one program holds (a prefill chunk) run as calls of max_rows rows."""
    q, k, v = _inputs(3, rows=32, seq=256)
    lengths = jnp.array([5, 130, 0], jnp.int32)
    split = tpu_dense_history_partials(q, k, v, lengths, block_k=128, max_rows=16, interpret=INTERPRET)
    _check(merge_partials(split, axis=2), dense_history_reference(q, k, v, lengths), 1e-5)
    with pytest.raises(ValueError, match="max_rows"):
        tpu_dense_history_partials(q, k, v, lengths, max_rows=24, interpret=INTERPRET)
    q, k, v = _inputs(0)
    with pytest.raises(ValueError, match="multiple of block_k"):
        tpu_dense_history_partials(q, k[:, :, :300], v[:, :, :300], jnp.array([1, 2, 3]), interpret=INTERPRET)
    with pytest.raises(ValueError, match="power of two"):
        tpu_dense_history_partials(q[:, :, :12], k, v, jnp.array([1, 2, 3]), interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiple of 8"):
        tpu_dense_history_partials(q, k, v, jnp.array([1, 2, 3]), block_k=12, interpret=INTERPRET)


@pytest.mark.parametrize("dtype,tol,chunk,per_program", [(jnp.float32, 1e-5, 32, 0), (jnp.bfloat16, 2e-2, 16, 2)])
def test_tpu_sparse_kernel_matches_reference_with_padding_and_duplicates(dtype, tol, chunk, per_program):
    """Row DMAs into double-buffered VMEM over >= 3 chunks: padded (-1), duplicate and
    out-of-range entries (cleaned), a row with nothing selected, a row whose last chunks are padding."""
    q, k, v = _inputs(7, dtype=dtype)
    lengths = jnp.array([0, 100, 317], jnp.int32)
    raw = np.random.RandomState(1).randint(-5, 330, (3, 128)).astype(np.int32)
    raw[1, 5] = raw[1, 4]  # a duplicate
    raw[2, :40] = 7  # many duplicates
    raw[2, 64:] = -1  # padding, two whole chunks of 32
    indices = clean_indices(jnp.asarray(raw), lengths)
    assert (np.asarray(indices)[0] == -1).all()
    partials = tpu_sparse_history_partials(q, k, v, indices, chunk=chunk, chunks_per_program=per_program,
                                           interpret=INTERPRET)
    assert partials[0].shape[2] == (1 if per_program == 0 else 128 // (chunk * per_program))
    _check(merge_partials(partials, axis=2), sparse_history_reference(q, k, v, indices), tol)
    with pytest.raises(ValueError, match="must divide"):
        tpu_sparse_history_partials(q, k, v, indices, chunk=32, chunks_per_program=3, interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiple of chunk"):
        tpu_sparse_history_partials(q, k, v, indices[:, :100], chunk=32, interpret=INTERPRET)


@pytest.mark.parametrize("groups,rows", [((1, 1, 1, 1), 3), ((0, 0, 0, 1), 8)])
def test_tpu_srh_scores_match_xla(groups, rows):
    """SRH logits from the Mosaic kernel == the XLA scoring (unused KV heads, ragged lengths
    not divisible by the block, 3 blocks)."""
    keys = jax.random.split(jax.random.PRNGKey(rows), 2)
    k = jax.random.normal(keys[0], (3, 2, 384, 32))
    queries = 0.3 * jax.random.normal(keys[1], (3, 4, rows, 32))
    lengths = jnp.array([384, 200, 7])
    expected = np.asarray(srh_scores(queries, k, lengths, groups))
    got = np.asarray(tpu_srh_scores(queries, k, lengths, groups, block_s=128, interpret=INTERPRET))
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6)
    assert (got[2, 7:] == 0).all() and (got[1, 200:] == 0).all()
    with pytest.raises(ValueError, match="kv_groups"):
        tpu_srh_scores(queries, k, lengths, (0, 1, 2, 0), interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu_srh_scores(queries, k, lengths, groups, block_s=64, interpret=INTERPRET)


# ---------------------------------------------------------------------------- the backends
TARGET = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32", attention_backend="xla")
DRAFT = TARGET.replace(hidden_size=32, intermediate_size=64, head_dim=8)
TPU = "pallas-tpu-interpret" if INTERPRET else "pallas-tpu"


def test_tpu_backends_registry_and_platform_errors():
    tpu, interp = attention.get_backend("pallas-tpu"), attention.get_backend(TPU)
    assert tpu.runs_on("tpu") and not tpu.runs_on("cpu") and not tpu.runs_on("gpu")
    assert interp.runs_on("cpu") and not interp.runs_on("gpu")
    assert init_cache(TARGET.replace(attention_backend=TPU), 1, 70).capacity == 128
    assert attention.platform_default_backend("tpu") == "pallas-tpu"
    assert attention.platform_default_backend("gpu") == attention.platform_default_backend("cpu") == "xla"
    assert ModelConfig.__dataclass_fields__["attention_backend"].default == "auto"
    assert attention.get_backend("auto").name == attention.platform_default_backend()
    with pytest.raises(ValueError, match=r"attention_backend='pallas-tpu' needs a TPU .*this platform is 'cpu'"):
        tpu.check_platform("cpu")
    with pytest.raises(ValueError, match="needs a CPU/TPU"):
        interp.check_platform("gpu")
    with pytest.raises(ValueError, match="'auto'"):
        attention.get_backend("mosaic")


@pytest.fixture(scope="module")
def models():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2), init_params(DRAFT, jax.random.PRNGKey(5), scale=0.2)


@pytest.mark.parametrize("sparse", [False, True])
def test_tpu_backend_forward_matches_xla(models, sparse):
    """Logits and probe probabilities of a verification step (dense, or sparse with padded,
    duplicate and out-of-range indices) equal the xla backend's."""
    params, _ = models
    rng = np.random.RandomState(0)
    prompt = jnp.asarray(rng.randint(0, 128, (3, 70)))
    lengths = jnp.array([70, 33, 5])
    steps = jnp.asarray(rng.randint(0, 128, (3, 4)))
    indices = jnp.asarray(np.random.RandomState(1).randint(-3, 80, (3, 40))) if sparse else None
    results = []
    for cfg in (TARGET, TARGET.replace(attention_backend=TPU)):
        cache = forward_jit(params, prompt, init_cache(cfg, 3, 128), config=cfg).cache.with_lengths(lengths)
        results.append(forward_jit(params, steps, cache, config=cfg, verify_indices=indices, probe_heads=((1, 3),)))
    assert _rel(results[1].logits, results[0].logits) < 1e-5
    probs_x = np.asarray(results[0].probes.history_probs)
    np.testing.assert_allclose(np.asarray(results[1].probes.history_probs)[..., :probs_x.shape[-1]], probs_x,
                               atol=1e-6)


PROMPTS = [np.random.RandomState(7).randint(0, 128, n).tolist() for n in (140, 30)]


def test_tpu_backend_greedy_speculative_and_dustin_equal_xla(models):
    """Greedy speculative decoding (== greedy AR) and Dustin sparse verification (k < context)
    emit the same tokens with the target on pallas-tpu-interpret as on xla (dense and sparse
    verification through the kernels; the draft stays on xla to keep the test short). Three new tokens
    take two rounds here: the second verifies against the cache the first one wrote through the kernels."""
    target_params, draft_params = models
    engine = EngineConfig(gamma=2, max_new_tokens=3)
    dustin = DustinConfig(budget=128, m=30, target_layer=1, target_heads=(0, 1, 2, 3), draft_layers=(0, 1),
                          draft_heads=((0, 1, 2, 3), (1, 3)), mode="hybrid")
    rows = {}
    for name in ("xla", TPU):
        target, draft = TARGET.replace(attention_backend=name), DRAFT  # the target's attention is under test
        classic = speculative_generate(target_params, target, PROMPTS, draft_policy=SeparateDraft(draft),
                                       draft_params=draft_params, engine=engine)
        draft_policy, verify = dustin_policies(dustin, target, draft)
        sparse = speculative_generate(target_params, target, PROMPTS, draft_policy=draft_policy,
                                      draft_params=draft_params, verify_policy=verify, engine=engine)
        rows[name] = (classic.rows(), sparse.rows())
        assert classic.metrics["rounds"] >= 2 and sparse.metrics["rounds"] >= 2, name
    assert rows[TPU] == rows["xla"]
    assert rows["xla"][0] == generate(target_params, TARGET, PROMPTS, 3).rows()
    assert [len(r) for r in rows["xla"][1]] == [3, 3]
