"""Shared fixtures: tiny random Hugging Face models of each family, saved once per session.

* ``JAX_PLATFORMS`` defaults to ``cpu`` (set before JAX is imported) so the suite never
  grabs an accelerator by accident; x64 stays off (the library runs in float32/bfloat16).
* ``tiny_models`` builds three tiny ``transformers`` models (seeded, weights perturbed with
  N(0, 0.05) noise so norms/biases are not trivial), saves them as Hugging Face folders and
  loads each with :func:`jaxspec.models.loading.load_hf_folder` in float32:

  - ``llama``: tied embeddings, GQA 4 query / 2 KV heads, 3 layers;
  - ``qwen2``: q/k/v bias, untied head, rope_theta 1e6;
  - ``llama31``: Llama-3.1 llama3 RoPE scaling (factor 8, low 1, high 4, original 8192,
    rope_theta 500000, max_position_embeddings 131072), untied head.

* Opt-in markers (registered in ``pyproject.toml``): ``qwen`` runs only with
  ``JAXSPEC_QWEN_TESTS=1``, ``network`` only with ``JAXSPEC_NETWORK_TESTS=1``, ``gpu`` only
  when ``jax.default_backend() == "gpu"``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

TINY_VOCAB = 128


def chi_square_pvalue(counts, probs) -> float:
    """Pearson chi-square goodness-of-fit p-value of sample ``counts [V]`` against ``probs [V]``
    (0 when a token of probability zero was sampled: certainly not this distribution)."""
    counts, probs = np.asarray(counts), np.asarray(probs)
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum():
        return 0.0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    from scipy import stats

    return stats.chi2.sf(stat, keep.sum() - 1)
TINY_FAMILIES = ("llama", "qwen2", "llama31")


# ---------------------------------------------------------------------------- opt-in markers
def pytest_collection_modifyitems(config, items):
    qwen_on = os.environ.get("JAXSPEC_QWEN_TESTS") == "1"
    network_on = os.environ.get("JAXSPEC_NETWORK_TESTS") == "1"
    gpu_on = None  # computed lazily: importing jax only if some test is marked gpu
    skip_qwen = pytest.mark.skip(reason="needs the real Qwen2.5-Coder weights; opt in with JAXSPEC_QWEN_TESTS=1")
    skip_network = pytest.mark.skip(reason="fetches from the package registry; opt in with JAXSPEC_NETWORK_TESTS=1")
    skip_gpu = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
    for item in items:
        if "qwen" in item.keywords and not qwen_on:
            item.add_marker(skip_qwen)
        if "network" in item.keywords and not network_on:
            item.add_marker(skip_network)
        if "gpu" in item.keywords:
            if gpu_on is None:
                import jax

                gpu_on = jax.default_backend() == "gpu"
            if not gpu_on:
                item.add_marker(skip_gpu)


# ---------------------------------------------------------------------------- tiny HF models
@dataclasses.dataclass
class TinyModel:
    """A tiny transformers model, its saved folder and our float32 load of it."""

    family: str
    folder: pathlib.Path
    hf_model: object  # transformers *ForCausalLM, float32, eval mode
    config: object  # jaxspec ModelConfig (dtype float32)
    params: object  # jaxspec ModelParams (float32)

    def hf_logits(self, tokens, position_ids=None) -> np.ndarray:
        """Full (no cache) transformers forward: ``tokens [B, T]`` -> float32 logits ``[B, T, V]``.

        ``position_ids [B, T]`` may be arbitrary (non-contiguous) RoPE positions; attention stays
        plain causal over the ``T`` tokens.
        """
        import torch

        with torch.no_grad():
            kwargs = {}
            if position_ids is not None:
                kwargs["position_ids"] = torch.as_tensor(np.asarray(position_ids), dtype=torch.long)
                # An explicit all-ones mask: without it transformers reads non-contiguous position_ids as
                # packed sequences and blocks attention across the jumps.
                kwargs["attention_mask"] = torch.ones(np.shape(tokens), dtype=torch.long)
            out = self.hf_model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long), use_cache=False,
                                **kwargs)
        return out.logits.float().numpy()


def _hf_config(family: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return LlamaConfig(**common, num_hidden_layers=3, tie_word_embeddings=True, rope_theta=10000.0,
                           max_position_embeddings=2048)
    if family == "qwen2":
        return Qwen2Config(**common, num_hidden_layers=2, tie_word_embeddings=False, rope_theta=1e6,
                           max_position_embeddings=32768, use_sliding_window=False)
    if family == "llama31":
        return LlamaConfig(**common, num_hidden_layers=2, tie_word_embeddings=False, rope_theta=500000.0,
                           max_position_embeddings=131072,
                           rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=8192))
    raise ValueError(family)


def build_tiny_hf_model(family: str, seed: int = 0):
    """A seeded tiny transformers model (float32, eager attention) with perturbed weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _hf_config(family)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``{family: TinyModel}`` for ``llama``, ``qwen2`` and ``llama31`` (built lazily, once)."""
    import torch

    from jaxspec.models.loading import load_hf_folder

    # One torch thread: tiny models gain nothing from more, and torch's OpenMP workers spin-waiting
    # next to XLA's CPU threads made each tiny forward ~100x slower on 2 cores.
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny_hf")

    class _Lazy(dict):
        def __missing__(self, family):
            model = build_tiny_hf_model(family, seed=TINY_FAMILIES.index(family))
            folder = root / family
            model.save_pretrained(str(folder))
            loaded = load_hf_folder(folder, dtype="float32", with_tokenizer=False)
            tiny = TinyModel(family, folder, model, loaded.config, loaded.params)
            self[family] = tiny
            return tiny

    return _Lazy()


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> TinyModel:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models) -> TinyModel:
    return tiny_models["qwen2"]


@pytest.fixture(scope="session")
def tiny_llama31(tiny_models) -> TinyModel:
    return tiny_models["llama31"]


def slow_engine_side(monkeypatch, slow: str, seconds: float = 0.25) -> None:
    """Make one side of the measured arbitration certainly slower: a host sleep after each call of the
    engine's speculative loop (``slow="speculative"``) or its plain-decoding stretch (``"ar"``)."""
    import time

    import jax

    from jaxspec.decoding import speculative as engine_module

    side = {"speculative": "run_loop", "ar": "plain_decode"}[slow]
    real = getattr(engine_module, side)

    def slowed(*args, **kwargs):
        out = real(*args, **kwargs)
        jax.block_until_ready(out)
        time.sleep(seconds)
        return out

    monkeypatch.setattr(engine_module, side, slowed)


def max_rel_error(ours, reference) -> float:
    """``max|ours - reference| / max|reference|`` (the parity metric)."""
    ours = np.asarray(ours, np.float64)
    reference = np.asarray(reference, np.float64)
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="session")
def rel_error():
    return max_rel_error


# ---------------------------------------------------------------------------- memory between modules
@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled executables after each test module: the suite compiles thousands of
    programs, and keeping all of them alive grows one process by gigabytes (CI machines are
    small; a compile that runs out of memory inside LLVM can crash instead of raising)."""
    yield
    import gc
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


def tiny_llama_folder(tmp_path, seed=0, name="tiny-llama"):
    """The conftest tiny Llama (vocab 128, 3 layers, 4 q / 2 kv heads) with a character tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / name
    build_tiny_hf_model("llama", seed=seed).save_pretrained(str(folder))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): i + 3 for i, c in enumerate(range(32, 127))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(folder))
    return folder


#: a tiny `dustin-speed` run (2 layers of a shrunken SmolLM2 shape, 320 tokens, batch 2) for CLI tests
DUSTIN_SPEED_ARGS = ["dustin-speed", "--target-shape", "smollm2-135m-shape", "--draft-shape", "smollm2-135m-shape", "--layers", "2",
        "--override", "vocab_size=512,hidden_size=128,intermediate_size=256",
        "--contexts", "320", "--batches", "2", "--budget", "128", "--tau", "2.5", "--new-tokens", "6",
        "--repeats", "1", "--attention-backend", "xla", "--copy-gib", "0.01", "--draft-heads", "0,1"]



def write_pair_speed_json(path, cases, *, gamma=4, budget=128, model="target-m", draft="draft-m", dtype="bfloat16"):
    """A synthetic ``pair-speed`` results file at ``path`` (what ``dustin-speed --tau-from`` reads):
    ``cases`` maps ``(context, batch)`` to ``{method: tau}``; each method's ``metrics`` get
    ``tau_untruncated = tau`` and ``tau = tau - 0.05`` (the truncated one, told apart). The
    non-case entries pair-speed writes (``copy_bandwidth``) are there too. Returns ``str(path)``."""
    import json

    out = {"copy_bandwidth": {"bytes": 8, "median_s": 1.0, "bandwidth_Bps": 8.0}}
    for (context, batch), taus in cases.items():
        case = {"context": context, "batch": batch, "rows": []}
        for method, tau in taus.items():
            case[method] = {"metrics": {"tau": tau - 0.05, "tau_untruncated": tau, "gamma": gamma}, "tok_s": 1.0}
        out[f"ctx{context}/b{batch}"] = case
    config = {"model": model, "draft": draft, "gamma": gamma, "budget": budget, "dtype": dtype, "contexts": "x"}
    path.write_text(json.dumps({"experiment": "pair-speed", "config": config, "environment": {}, "cases": out}))
    return str(path)

# ---------------------------------------------------------------------------- kernel tests (GPU and TPU)
def relative_norm_error(a, b) -> float:
    """``|a - b| / |b|`` over all elements (float64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def kernel_inputs(seed, batch=3, kv_heads=2, rows=16, dim=32, seq=320, dtype=None):
    """Random packed queries ``[B, Hkv, M, D]`` and a K/V cache ``[B, Hkv, S, D]`` for kernel tests."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.float32 if dtype is None else dtype
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = (0.3 * jax.random.normal(keys[0], (batch, kv_heads, rows, dim))).astype(dtype)
    k = jax.random.normal(keys[1], (batch, kv_heads, seq, dim)).astype(dtype)
    v = jax.random.normal(keys[2], (batch, kv_heads, seq, dim)).astype(dtype)
    return q, k, v


def check_partials(partial, reference, tol, *, with_empty_row: bool = False) -> None:
    """A kernel's merged ``(acc, l, m)`` against its reference: no NaN, the same empty (all-masked)
    rows, the normalised output within ``tol`` (relative norm) and the same row maxima.
    ``with_empty_row``: the inputs hold an all-masked row and some valid ones."""
    from pallas_kernels.reference import normalize

    acc, l, m = partial
    _, ref_l, ref_m = reference
    assert not np.isnan(np.asarray(acc)).any()
    empty = np.asarray(ref_l) == 0
    if with_empty_row:
        assert empty.any() and not empty.all()
    np.testing.assert_array_equal(np.asarray(l) == 0, empty)  # same rows are empty
    assert relative_norm_error(normalize(partial), normalize(reference)) < tol
    np.testing.assert_allclose(np.where(empty, 0, m), np.where(empty, 0, ref_m), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- KnapSpec DP oracles
def decomposable_increments(num_layers, tokens=3, hidden=24, seed=0):
    """The orthogonal increments of :func:`decomposable_dp_instance`: ``(inc [2n+1, T, H], mags, scale,
    bases)`` -- increment k is ``scale[t] * mags[k] * bases[t][:, k]`` for token t."""
    rng = np.random.RandomState(seed)
    n = num_layers - 1  # scanned layers 1..L-1
    mags = rng.uniform(0.3, 1.5, size=2 * n + 1)
    mags[0] = 1.2
    scale = rng.uniform(0.5, 2.0, size=tokens)
    bases = [np.linalg.qr(rng.randn(hidden, hidden))[0] for _ in range(tokens)]
    inc = np.stack([np.stack([scale[t] * mags[k] * bases[t][:, k] for t in range(tokens)])
                    for k in range(2 * n + 1)]).astype(np.float32)
    return inc, mags, scale, bases


def decomposable_dp_instance(num_layers, tokens=3, hidden=24, seed=0):
    """Orthogonal-increment 'model' on which the knapsack DP is exact (tests/knapspec/test_knapspec.py):
    boundary 2 is a_0 e_0 and sub-layer k adds a_k e_k (orthonormal e_k, per token a rotated basis
    and a per-token scale), whatever the input state. Returns ``(g0, steps [n, 2, T, H], targets)``."""
    import jax.numpy as jnp

    n = num_layers - 1
    inc = decomposable_increments(num_layers, tokens, hidden, seed)[0]
    return (jnp.asarray(inc[0]), jnp.asarray(inc[1:].reshape(n, 2, tokens, hidden)),
            jnp.asarray(np.cumsum(inc, axis=0)[1:].reshape(n, 2, tokens, hidden)))


def check_scan_dp_against_brute_force(g0, steps, targets, can_skip, *, num_layers, w_attn, w_mlp, tau, segments=1,
                                      layers="scan"):
    """Run the scan DP on an additive instance and the exhaustive search; assert that the DP's value and
    mask at every weight it reports equal brute force's optimum and that both find the same weights.
    Returns a namespace: ``trace, masks, slots, best``, ``brute(can_skip, tau)`` (the exhaustive search
    again on the same instance) and the instance as ``dp.dp_loop`` takes it (``single, layers,
    targets, token_mask, budget``). ``segments``: the scan split into at most that many runs of reachable slots
    (``dp.slot_segments``); ``layers="unrolled"``: ``dp.dp_unrolled`` (one traced step per layer) instead."""
    import types

    import jax
    import jax.numpy as jnp
    import pytest

    from jaxspec.knapspec import dp

    token_mask = jnp.ones(g0.shape[:1])
    budget = dp.skip_budget(w_attn, w_mlp, num_layers)
    apply = lambda kind: (lambda layer_x, g: g + layer_x[kind])  # noqa: E731
    if layers == "unrolled":
        values, skipped, valid, _ = jax.jit(lambda: dp.dp_unrolled(
            apply(0), apply(1), [(steps[k, 0], steps[k, 1]) for k in range(num_layers - 1)], g0, targets, can_skip,
            token_mask, w_attn=w_attn, w_mlp=w_mlp, budget=budget, tau=tau))()
    else:
        values, skipped, valid, _ = jax.jit(lambda: dp.dp_scan(
            apply(0), apply(1), (steps[:, 0], steps[:, 1]), g0, targets, jnp.asarray(can_skip), token_mask,
            w_attn=w_attn, w_mlp=w_mlp, budget=budget, tau=tau,
            segments=dp.slot_segments(can_skip, w_attn, w_mlp, budget, segments)))()
    trace = dp.DPTrace(np.asarray(values, np.float64), np.asarray(skipped), np.asarray(valid))
    masks, slots = dp.backtrack(trace, num_layers, w_attn, w_mlp)
    layers = [(steps[k, 0], steps[k, 1]) for k in range(num_layers - 1)]
    targets_list = [(targets[k, 0], targets[k, 1]) for k in range(num_layers - 1)]

    def brute(can, tau_):
        return dp.brute_force(lambda kind, layer_x, h: h + layer_x[kind], layers, g0, targets_list, can,
                              token_mask, w_attn=w_attn, w_mlp=w_mlp, budget=budget, tau=tau_)

    best = brute(can_skip, tau)
    assert sorted(best) == slots.tolist()
    for c, j in enumerate(slots):
        value, skips = best[int(j)]
        assert trace.final_values[j] == pytest.approx(value, rel=1e-5)
        expected = np.zeros((num_layers, 2), bool)
        for layer, col in skips:
            expected[1 + layer, col] = True
        np.testing.assert_array_equal(masks[c], expected)
    return types.SimpleNamespace(trace=trace, masks=masks, slots=slots, best=best, brute=brute,
                                 single=lambda kind, layer_x, h: h + layer_x[kind], layers=layers,
                                 targets=targets_list, token_mask=token_mask, budget=budget)



def dp_model_problem(params, config, *, width: int = 8, capacity: int = 64, ragged: bool = True):
    """The KnapSpec DP's reference on a model: a 2-row cache holding the full model's K/V of every
    position (a 20-token prompt and the reference window), prefixes 20 and 17, the ``width`` reference
    tokens of each row at its prefix and their boundary states (``dp.boundary_states``); ``ragged``:
    row 1 has only 6 real reference tokens (padding after). Returns ``(cache, prefix, tokens,
    token_mask, states)``."""
    import jax.numpy as jnp

    from jaxspec.knapspec import dp
    from jaxspec.models.cache import init_cache
    from jaxspec.models.llama import forward_jit

    batch, prompt = 2, 20
    seq = np.random.RandomState(0).randint(0, config.vocab_size, (batch, prompt + width))
    cache = forward_jit(params, jnp.asarray(seq), init_cache(config, batch, capacity), config=config).cache
    prefix = jnp.asarray([prompt, prompt - 3], jnp.int32)
    tokens = jnp.asarray(np.stack([seq[0, prompt:prompt + width], seq[1, prompt - 3:prompt - 3 + width]]))
    token_mask = np.ones((batch, width), np.float32)
    if ragged:
        token_mask[1, 6:] = 0
    states = dp.boundary_states(params, config, tokens, cache, prefix)
    return cache, prefix, tokens, jnp.asarray(token_mask), states


def check_same_candidates(got, ref, *, weights: bool = False) -> None:
    """Two runs of the KnapSpec DP on one problem (``dp.Candidates``, the scan's with ``keep_states``)
    agree: the trace's valid slots and skip choices, its values on the valid slots, the backtracked
    masks (and ``weights``), alphas and final states; and the instance is non-trivial (> 3 candidates)."""
    np.testing.assert_array_equal(got.trace.valid, ref.trace.valid)
    np.testing.assert_array_equal(got.trace.skipped, ref.trace.skipped)
    ok = ref.trace.valid
    np.testing.assert_allclose(got.trace.values[ok], ref.trace.values[ok], rtol=1e-5)
    np.testing.assert_array_equal(got.masks, ref.masks)
    if weights:
        np.testing.assert_array_equal(got.weights, ref.weights)
    np.testing.assert_allclose(got.alpha, ref.alpha, atol=1e-6)
    np.testing.assert_allclose(got.final_states, ref.final_states, rtol=1e-4, atol=1e-4)
    assert len(got) > 3  # a non-trivial instance: several budgets survive
