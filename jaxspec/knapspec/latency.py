"""KnapSpec latency model (SPEC 4.1): ``t_mlp = c1``, ``t_attn(n) = c2 * n + c3``, plus a
per-token constant ``t_token = c0`` (beyond SPEC 4.1, which has no term for it).

``c0`` is the part of every forward (draft or target) that no skip set removes: the embedding
lookup, the final RMSNorm, the LM head and the greedy argmax. On SmolLM2-135M (49k-token tied
head, 30 thin layers) it is ~a fifth of a CPU decode step; a model without it overstates what
skipping saves (``t_draft / t_target`` too small), so the TPT would prefer drafting where it
does not pay. It is profiled like the sub-layers and enters both ``t_draft`` and ``t_target``
(:mod:`jaxspec.knapspec.planner`).

A second extension, ``v`` (``verify_row_cost``): the relative extra cost of each verified row
beyond the first, ``t_verify(g + 1 rows) = t_step (1 + v g)``. SPEC 4.2 takes verification as
one decode step (``v = 0``), right where a step is memory-bound (a GPU at small batch) and wrong
where it is compute-bound: on a 2-core CPU SmolLM2 verifies 11 rows in ~2x the time of 3. It
is profiled from one layer and the head at ``verify_rows`` rows vs one row, at the largest
profiled context.

The coefficients are fitted by least squares from timings of *one* Attention sub-layer at
several context lengths ``n`` and of one MLP sub-layer, measured in our own stack
(:func:`jaxspec.models.llama.attention_block` / :func:`~jaxspec.models.llama.mlp_block`, one
decode query row per sequence) on the current device at a given batch size, with random
parameters of the given :class:`~jaxspec.config.ModelConfig` and a KV cache filled to ``n``.

A profile is saved as JSON (device, jax version, config name and fields, batch, raw
measurements and the fit) and reused by :func:`load_or_profile` when device, config and batch
match.

Note on the ``xla`` attention backend: the jnp reference attention reads the whole cache
buffer (``S_max`` slots, masked), so *in the engine* its cost follows the cache capacity, not
the number of valid positions. The profiler allocates a cache of exactly ``n`` slots, so
``t_attn(n)`` is the cost of attending to ``n`` positions; evaluate it at
:func:`effective_context` (capacity for ``xla``, valid length for the Pallas kernels).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig

#: Context lengths the paper profiles (1k .. 25k); callers usually cap them at the evaluated context.
DEFAULT_CONTEXTS = tuple(range(1024, 25 * 1024 + 1, 2048))
#: 2: the per-token constant c0; 3: the verification row cost v (older profiles are re-measured)
FORMAT_VERSION = 3


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """``t_mlp = c1``; ``t_attn(n) = c2 * n + c3`` (seconds per sub-layer, one decode step);
    ``t_token = c0`` (seconds per forward for embeddings + final norm + LM head + argmax);
    ``v``: verifying ``g + 1`` rows costs ``(1 + v g)`` decode steps."""

    c1: float
    c2: float
    c3: float
    c0: float = 0.0
    v: float = 0.0

    def t_mlp(self) -> float:
        return float(self.c1)

    def t_attn(self, n) -> float:
        return float(self.c2 * float(n) + self.c3)

    def t_token(self) -> float:
        return float(self.c0)

    def t_step(self, n, num_layers: int) -> float:
        """Predicted full-model decode step at context ``n``: ``L (t_attn(n) + t_mlp) + t_token``."""
        return float(num_layers) * (self.t_attn(n) + self.t_mlp()) + self.t_token()

    def as_dict(self) -> Dict[str, float]:
        return {"c1": float(self.c1), "c2": float(self.c2), "c3": float(self.c3), "c0": float(self.c0),
                "v": float(self.v)}


def verify_row_cost(step_one_row: float, step_rows: float, rows: int) -> float:
    """``v`` from a step of one row and a step of ``rows`` rows: ``(ratio - 1) / (rows - 1)``,
    clipped at 0 (more rows never cost less)."""
    if rows < 2 or step_one_row <= 0:
        raise ValueError(f"need rows >= 2 and a positive one-row time; got rows={rows}, {step_one_row}")
    return max(0.0, (float(step_rows) / float(step_one_row) - 1.0) / (int(rows) - 1))


def fit_latency(contexts: Sequence[float], attn_times: Sequence[float], mlp_times: Sequence[float],
                token_times: Optional[Sequence[float]] = None, v: float = 0.0) -> LatencyModel:
    """Least-squares fit: ``c2, c3`` of ``t_attn = c2 n + c3`` over (n, t) pairs; ``c1`` the
    least-squares constant of the MLP times (their mean); ``c0`` that of the per-token times
    (their mean; 0 when none are given)."""
    n = np.asarray(contexts, np.float64).reshape(-1)
    t = np.asarray(attn_times, np.float64).reshape(-1)
    if n.shape != t.shape or n.size < 2:
        raise ValueError(f"need >= 2 (context, attention time) pairs of equal length; got {n.size} and {t.size}")
    if np.unique(n).size < 2:
        raise ValueError("need at least two distinct context lengths to fit t_attn(n) = c2 n + c3")
    design = np.stack([n, np.ones_like(n)], axis=1)
    (c2, c3), *_ = np.linalg.lstsq(design, t, rcond=None)
    mlp = np.asarray(mlp_times, np.float64).reshape(-1)
    if mlp.size < 1:
        raise ValueError("need at least one MLP time")
    c0 = 0.0
    if token_times is not None:
        token = np.asarray(token_times, np.float64).reshape(-1)
        if token.size < 1:
            raise ValueError("token_times is empty; pass None for a model without the per-token constant")
        c0 = float(token.mean())
    return LatencyModel(c1=float(mlp.mean()), c2=float(c2), c3=float(c3), c0=c0, v=float(v))


@dataclasses.dataclass
class LatencyProfile:
    """Raw measurements and their fit, with what they were measured on."""

    device: str
    platform: str
    jax_version: str
    config_name: str
    config: dict
    batch: int
    contexts: List[int]
    attn_times: List[float]  # median seconds per context
    mlp_time: float  # median seconds
    attn_samples: List[List[float]]  # every repeat, per context
    mlp_samples: List[float]
    model: LatencyModel
    repeats: int = 0
    warmup: int = 0
    token_time: float = 0.0  # median seconds of embeddings + final norm + LM head + argmax
    token_samples: List[float] = dataclasses.field(default_factory=list)
    verify_rows: int = 0  # rows of the verification timing (0: not measured)
    verify_times: Dict[str, float] = dataclasses.field(default_factory=dict)  # attn/mlp/token, 1 and R rows

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["model"] = self.model.as_dict()
        data["format_version"] = FORMAT_VERSION
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "LatencyProfile":
        data = json.loads(text)
        version = data.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise ValueError(f"latency profile format {version!r}; this jaxspec reads format {FORMAT_VERSION}")
        data["model"] = LatencyModel(**data["model"])
        return cls(**data)

    def save(self, path) -> None:
        path = os.fspath(path)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path) -> "LatencyProfile":
        with open(os.fspath(path)) as f:
            return cls.from_json(f.read())

    def matches(self, config: ModelConfig, batch: int, device: Optional[str] = None) -> bool:
        """Same device, same model config (all fields) and same batch size."""
        return (self.device == (device or device_name()) and self.batch == int(batch)
                and self.config == _config_fields(config))


def device_name(device=None) -> str:
    device = device or jax.devices()[0]
    return f"{device.platform}:{device.device_kind}"


def _config_fields(config: ModelConfig) -> dict:
    return json.loads(json.dumps(config.to_dict()))  # JSON-normalised (tuples become lists)


def effective_context(config: ModelConfig, lengths, capacity: int) -> float:
    """The ``n`` at which to evaluate ``t_attn`` during decoding: the cache capacity for the
    ``xla`` backend (it reads every slot), the mean valid length for the Pallas kernels."""
    if config.attention_backend == "xla":
        return float(capacity)
    return float(np.mean(np.asarray(jax.device_get(lengths))))


# ---------------------------------------------------------------------------- profiler
def _median_time(fn, args, warmup: int, repeats: int) -> List[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return samples


def profile_latency(config: ModelConfig, batch: int = 1, contexts: Sequence[int] = DEFAULT_CONTEXTS, *,
                    warmup: int = 3, repeats: int = 10, seed: int = 0, verify_rows: int = 11) -> LatencyProfile:
    """Time one Attention sub-layer at each context in ``contexts``, one MLP sub-layer and the
    per-token part (embedding lookup of ``batch`` tokens, final RMSNorm, LM head, argmax).

    One decode step: ``batch`` sequences, one new query row each, attending to a cache of ``n``
    random keys/values (capacity ``n``, rounded up to 64 for the Pallas backends). Each point
    is the median of ``repeats`` timed calls after ``warmup`` untimed ones
    (``block_until_ready`` around each call; compile happens in the warm-up).
    """
    from jaxspec.models.cache import init_cache
    from jaxspec.models.llama import attention_block, init_params, mlp_block, rms_norm, rope_tables

    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup={warmup} and repeats={repeats} must be >= 1 (warm-up compiles)")
    contexts = [int(n) for n in contexts]
    if len(contexts) < 2 or min(contexts) < 1:
        raise ValueError(f"need >= 2 positive context lengths; got {contexts}")
    one_layer = config.replace(num_layers=1)
    key = jax.random.PRNGKey(seed)
    k_params, k_h, k_cache = jax.random.split(key, 3)
    params = init_params(one_layer, k_params)
    layer = params["layers"][0]
    dtype = config.jnp_dtype
    h = jax.random.normal(k_h, (batch, 1, config.hidden_size), jnp.float32).astype(dtype)

    @jax.jit
    def attn_fn(layer, h, cache_k, cache_v, lengths):
        cos, sin = rope_tables(config, lengths[:, None] + jnp.arange(h.shape[1])[None, :])
        return attention_block(layer, h, config, cos, sin, cache_k, cache_v, lengths, None, ())[0]

    mlp_fn = jax.jit(lambda layer, h: mlp_block(layer, h, config))

    @jax.jit
    def token_fn(outer, tokens, h):
        # as in the forward (llama._forward); the embedding row is added to the (random) hidden
        # state so the lookup is not dead code
        x = h + outer["embed"][tokens].astype(dtype)
        x = rms_norm(x, outer["final_norm"], config.rms_norm_eps)
        head = outer["embed"].T if config.tie_word_embeddings else outer["lm_head"]
        logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
        return jnp.argmax(logits, axis=-1)

    attn_samples = []
    verify_times: Dict[str, float] = {}
    rows = int(verify_rows)
    h_rows = jax.random.normal(jax.random.fold_in(k_h, 1), (batch, max(rows, 1), config.hidden_size),
                               jnp.float32).astype(dtype)
    for n in contexts:
        cache = init_cache(one_layer, batch, n, lengths=jnp.full((batch,), n, jnp.int32))
        kk, kv = jax.random.split(jax.random.fold_in(k_cache, n))
        cache_k = jax.random.normal(kk, cache.keys[0].shape, jnp.float32).astype(dtype)
        cache_v = jax.random.normal(kv, cache.values[0].shape, jnp.float32).astype(dtype)
        attn_samples.append(_median_time(attn_fn, (layer, h, cache_k, cache_v, cache.lengths), warmup, repeats))
        if rows >= 2 and n == max(contexts):  # the verification rows at the largest context
            start_lengths = jnp.full((batch,), n - rows, jnp.int32)
            verify_times["attn_rows"] = statistics.median(
                _median_time(attn_fn, (layer, h_rows, cache_k, cache_v, start_lengths), warmup, repeats))
            verify_times["attn_one"] = statistics.median(attn_samples[-1])
        del cache, cache_k, cache_v
    mlp_samples = _median_time(mlp_fn, (layer, h), warmup, repeats)
    outer = {k: v for k, v in params.items() if k != "layers"}
    token_ids = jax.random.randint(jax.random.fold_in(key, 1), (batch, 1), 0, config.vocab_size)
    token_samples = _median_time(token_fn, (outer, token_ids, h), warmup, repeats)
    attn_times = [statistics.median(s) for s in attn_samples]
    mlp_time = statistics.median(mlp_samples)
    token_time = statistics.median(token_samples)
    v = 0.0
    if rows >= 2:
        verify_times["mlp_rows"] = statistics.median(_median_time(mlp_fn, (layer, h_rows), warmup, repeats))
        verify_times["token_rows"] = statistics.median(_median_time(
            token_fn, (outer, jnp.zeros((batch, rows), jnp.int32), h_rows), warmup, repeats))
        verify_times.update(mlp_one=mlp_time, token_one=token_time)
        layers = config.num_layers
        one = layers * (verify_times["attn_one"] + mlp_time) + token_time
        many = layers * (verify_times["attn_rows"] + verify_times["mlp_rows"]) + verify_times["token_rows"]
        v = verify_row_cost(one, many, rows)
    model = fit_latency(contexts, attn_times, [mlp_time], [token_time], v=v)
    return LatencyProfile(device=device_name(), platform=jax.devices()[0].platform, jax_version=jax.__version__,
                          config_name=config.name, config=_config_fields(config), batch=int(batch),
                          contexts=contexts, attn_times=attn_times, mlp_time=mlp_time, attn_samples=attn_samples,
                          mlp_samples=mlp_samples, model=model, repeats=repeats, warmup=warmup,
                          token_time=token_time, token_samples=token_samples, verify_rows=rows if rows >= 2 else 0,
                          verify_times=verify_times)


def load_or_profile(path, config: ModelConfig, batch: int = 1, *, profile_fn: Callable = profile_latency,
                    **profile_kwargs) -> LatencyProfile:
    """Reuse the profile at ``path`` if it was measured on this device for this config and batch;
    otherwise measure (``profile_fn(config, batch, **profile_kwargs)``) and save it there."""
    if path is not None and os.path.exists(os.fspath(path)):
        try:
            profile = LatencyProfile.load(path)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            profile = None
        if profile is not None and profile.matches(config, batch):
            return profile
    profile = profile_fn(config, batch, **profile_kwargs)
    if path is not None:
        profile.save(path)
    return profile
