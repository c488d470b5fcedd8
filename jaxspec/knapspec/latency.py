"""KnapSpec latency model (docs/methods.md §4.1): ``t_mlp = c1``, ``t_attn(n) = c2 * n + c3``, plus a
per-token constant ``t_token = c0`` (beyond docs/methods.md §4.1, which has no term for it).

``c0`` is the part of every forward (draft or target) that no skip set removes: the embedding
lookup, the final RMSNorm, the LM head and the greedy argmax. On SmolLM2-135M (49k-token tied
head, 30 thin layers) it is ~a fifth of a CPU decode step; a model without it overstates what
skipping saves (``t_draft / t_target`` too small), so the TPT would prefer drafting where it
does not pay. It is profiled like the sub-layers and enters both ``t_draft`` and ``t_target``
(:mod:`jaxspec.knapspec.planner`).

A second extension, ``v`` (``verify_row_cost``): the relative extra cost of each verified row
beyond the first, ``t_verify(g + 1 rows) = t_step (1 + v g)``. docs/methods.md §4.2 takes verification as
one decode step (``v = 0``), right where a step is memory-bound (a GPU at small batch) and wrong
where it is compute-bound: on a 2-core CPU SmolLM2 verifies 11 rows in ~2x the time of 3. It
is profiled from one layer and the head at ``verify_rows`` rows vs one row, at the largest
profiled context.

The coefficients are fitted by least squares from timings of *one* Attention sub-layer at
several context lengths ``n`` and of one MLP sub-layer, measured in our own stack
(:func:`jaxspec.models.layers.attention_sublayer` / :func:`~jaxspec.models.layers.mlp_sublayer`, one
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

Three ways to measure (``method``, the profile's ``method`` field):

* ``"isolated"`` (:func:`profile_latency`, the original): each sub-layer timed alone, one jitted
  call per sub-layer. Launch-bound on a GPU at small batch (every call pays a dispatch the real
  decode loop does not) and blind to what a whole forward costs beyond the sum of its parts.
* ``"forward"`` (:func:`profile_latency_forward`): whole forwards of the real model in the form
  the engine runs them -- ``forward`` with the KnapSpec draft's dynamic skip mask, several
  steps inside one jitted ``fori_loop`` carrying the (donated) cache, so per-step cost is that
  of a step inside the decode loop, not of a host dispatch. At each profiled context ``n``:
  ``T_full(n)`` (no sub-layer skipped), ``T_noattn(n)`` (every skippable Attention skipped:
  layers ``1 .. L-2``; layer 0 and ``L-1`` never are), ``T_nomlp(n)`` (every skippable MLP
  skipped), and at the largest context ``T_verify(r)``, the full model (no mask, as the
  verifier) on ``r`` rows. :func:`fit_forward` turns them into the same :class:`LatencyModel`::

      S = L - 2 (skippable sub-layers of each kind)
      c1 = mean_n (T_full(n) - T_nomlp(n)) / S                  (clamped at 0)
      t_attn(n) = (T_full(n) - T_noattn(n)) / S  ->  c2 n + c3  (least squares)
      c0 = mean_n [T_full(n) - L (c1 + c2 n + c3)]             (clamped at 0)
      (half masks: S = ceil((L - 2) / 2) skipped, and that remainder fitted as c0 + c0_n n)
      T_verify(r) = t_step(n_verify) (a + v (r - 1))  (least squares in a, v)  (clamped)

  so the modelled step reproduces ``T_full(n)`` (least squares over ``n``), a draft skipping
  every skippable Attention (MLP) reproduces ``T_noattn`` (``T_nomlp``), and the modelled
  verification ``t_step (a + v g)`` reproduces the least-squares line through
  ``T_verify(g + 1)`` -- whatever the launch or fusion behaviour of one sub-layer alone.
  ``a`` (the target's one-row forward in draft-form steps) has its own intercept because the
  target's forwards run without the skip mask: on the 2-core CPU the verifier's one-row forward
  measured ~1.35x the draft-form step with nothing skipped; on the H200 the dynamic mask's
  conditionals made the draft-form step ~2x the target's. Plain decoding (gamma = 0) is priced
  at ``a t_step`` too. (``v_anchored_at_step`` in ``forward["fit"]`` is the earlier ``a = 1``
  fit, kept for comparison; the unclamped values are kept there as well.)
* ``"forward-static"`` (``profile_latency_forward(static_masks=True)``): the same forwards and fit
  with each mask compiled in (skipped sub-layers removed at trace time, no per-sub-layer
  conditional), the form of a plan compiled for itself (``--knapspec-static-plans``, budget plans,
  the static skip set). On a GPU each conditional costs a host round trip, so the two fits differ
  there; on the CPU they agree.
* ``"forward-half"`` / ``"forward-static-half"`` (``half_masks=True``): the same, with ``noattn`` /
  ``nomlp`` skipping every second skippable sub-layer of their kind (``ceil(S / 2)`` of them) and
  each sub-layer priced at that mask's saving over the number it skips: the DP's plans skip about
  half of a kind, so their prices come from masks of that size, should a device's saving per
  sub-layer depend on how many are skipped (on an H100 at batch 1 it did not: docs/methods.md §4.1).

Profile files: format 4 adds ``method`` and ``forward``; format-3 files still load (as
``method="isolated"``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models.attention import backend_of

#: Context lengths the paper profiles (1k .. 25k); callers usually cap them at the evaluated context.
DEFAULT_CONTEXTS = tuple(range(1024, 25 * 1024 + 1, 2048))
#: 2: the per-token constant c0; 3: the verification row cost v (older profiles are re-measured);
#: 4: ``method`` ("isolated" | "forward") and the forward measurements (format 3 still loads);
#: 7: a forward profile's per-call cost (``long_steps_per_call``; older forward profiles are measured again)
FORMAT_VERSION = 7
READABLE_FORMATS = (3, 4, 5, 6, 7)
#: how the coefficients were measured: one sub-layer per call, or whole forwards of the model
FIT_METHODS = ("isolated", "forward", "forward-static", "forward-half", "forward-static-half")
#: verification rows (gamma + 1) timed by the forward profiler
DEFAULT_VERIFY_ROWS = (1, 2, 4, 8, 11)
#: row counts of the many-row forwards timed for ``u``, the cost of one more row at scale (the DP's slot states)
DEFAULT_BULK_ROWS = (64, 256)


class ProfileFormatError(ValueError):
    """A latency profile written by an older (unreadable) format: measured again by
    :func:`load_or_profile`."""


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """``t_mlp = c1``; ``t_attn(n) = c2 * n + c3`` (seconds per sub-layer, one decode step);
    ``t_token(n) = c0 + c0_n n`` (seconds per forward for embeddings + final norm + LM head + argmax,
    and, for a half-mask fit, the part of the step that the sub-layers' prices leave: ``c0_n`` is 0
    for every other fit);
    ``v``: verifying ``g + 1`` rows costs ``(a + v g)`` decode steps; ``a`` (default 1): the
    target's own forwards -- verification and plain decoding, which run without the draft's
    skip mask -- cost ``a`` draft-form steps per row-1 call (a whole-forward fit measures it; on
    a GPU the dynamic skip mask makes the draft-form step dearer than the target's, ``a < 1``).
    ``u + u_n n``: seconds of one more row in a forward of many rows (``DEFAULT_BULK_ROWS``) at context ``n``
    (:meth:`t_row`), the price the DP's ``J x r`` slot states pay (``w + w_n n``: that line's intercept, what each
    such forward pays whatever its rows, :meth:`t_pass`): each row attends to the whole
    context, so on a GPU the price grows with ``n``. Measured at the smallest and the largest profiled
    contexts that exceed the row count (``u_n = 0`` when only one was measured); both 0 = not measured. ``v`` comes from
    at most ``gamma + 1`` rows, where a GPU is still bound by the weights' bytes; extrapolated to the
    DP's hundreds of rows (Qwen2.5-Coder-1.5B on the H200: 0.11 ms a row) it predicted a DP too dear
    to run at 8k, batch 1 (docs/methods.md §4.1). ``p``: the decode loop's own step over ``t_step``
    (:meth:`t_plain`, the price of plain decoding in the planning allowance and the arbitration's model;
    0 = not measured, ``a`` stands in)."""

    c1: float
    c2: float
    c3: float
    c0: float = 0.0
    v: float = 0.0
    a: float = 1.0
    u: float = 0.0
    u_n: float = 0.0
    p: float = 0.0
    c0_n: float = 0.0
    w: float = 0.0
    w_n: float = 0.0

    def t_mlp(self) -> float:
        return float(self.c1)

    def t_attn(self, n) -> float:
        """Seconds of one Attention sub-layer at context ``n``: ``c2 n + c3``, never below 0 (a fitted
        line with ``c3 < 0`` -- noise on a model whose steps are microseconds -- would otherwise price a
        sub-layer at short contexts below nothing, and a plan's draft step below 0)."""
        return max(0.0, float(self.c2 * float(n) + self.c3))

    def t_token(self, n) -> float:
        """Seconds a forward at context ``n`` pays whatever it skips: ``c0 + c0_n n``, never below 0."""
        return max(0.0, float(self.c0 + self.c0_n * float(n)))

    def t_row(self, n) -> float:
        """Predicted seconds of one more row in a many-row forward at context ``n``: ``u + u_n n``,
        never below 0 (0: the many-row slope was not measured)."""
        return max(0.0, float(self.u + self.u_n * float(n)))

    def t_pass(self, n) -> float:
        """Predicted seconds a many-row forward at context ``n`` pays whatever its row count: ``w + w_n n``, the
        intercept of the many-row line (reading the weights and the cache once), never below 0 (0: not
        measured). Each separate pass of a plan (the DP, the rescoring, the window's states) pays it once."""
        return max(0.0, float(self.w + self.w_n * float(n)))

    def t_extra_row(self, n, num_layers: int) -> float:
        """The price of one more row through the whole model at context ``n`` (a DP's slot state):
        :meth:`t_row` where the profile measured the many-row slope, else the verification-row cost
        ``v t_step(n)``; 0 when neither is known."""
        row = self.t_row(n)
        return row if row > 0 else float(self.v) * self.t_step(n, num_layers)

    def t_step(self, n, num_layers: int) -> float:
        """Predicted full-model decode step at context ``n``: ``L (t_attn(n) + t_mlp) + t_token``."""
        return float(num_layers) * (self.t_attn(n) + self.t_mlp()) + self.t_token(n)

    @property
    def plain_ratio(self) -> float:
        """Plain decoding's step in modelled steps: ``p`` where measured, else ``a``."""
        return float(self.p if self.p > 0 else self.a)

    def t_plain(self, n, num_layers: int) -> float:
        """Predicted step of plain decoding at context ``n``: ``p t_step(n)`` where the profile timed the
        decode loop itself (``p`` > 0), else ``a t_step(n)`` (the target's one-row forward, extrapolated from
        the verification rows' line). The two can differ where the decode loop and a forward of a few rows
        compile or scale differently."""
        return self.plain_ratio * self.t_step(n, num_layers)

    def as_dict(self) -> Dict[str, float]:
        return {"c1": float(self.c1), "c2": float(self.c2), "c3": float(self.c3), "c0": float(self.c0),
                "v": float(self.v), "a": float(self.a), "u": float(self.u), "u_n": float(self.u_n),
                "p": float(self.p), "c0_n": float(self.c0_n), "w": float(self.w), "w_n": float(self.w_n)}


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
    method: str = "isolated"  # FIT_METHODS: how the coefficients were measured
    forward: Dict[str, Any] = dataclasses.field(default_factory=dict)  # method "forward": raw times and fit

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["model"] = self.model.as_dict()
        data["format_version"] = FORMAT_VERSION
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "latency profile") -> "LatencyProfile":
        """Parse a saved profile; every problem is a ``ValueError`` naming the offending value
        (:class:`ProfileFormatError` for a format this code no longer reads)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: not valid JSON ({err})") from err
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        version = data.pop("format_version", None)
        if version not in READABLE_FORMATS:
            raise ProfileFormatError(f"{source}: format_version {version!r}; this jaxspec reads formats "
                                     f"{list(READABLE_FORMATS)} (older profiles are measured again)")
        method = data.setdefault("method", "isolated")
        if method not in FIT_METHODS:
            raise ValueError(f"{source}: method {method!r} is not one of {list(FIT_METHODS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing, unknown = sorted(required - set(data)), sorted(set(data) - fields)
        if missing or unknown:
            raise ValueError(f"{source}: missing fields {missing}, unknown fields {unknown}")
        model = data["model"]
        names = {f.name for f in dataclasses.fields(LatencyModel)}
        if not isinstance(model, dict) or not {"c1", "c2", "c3"} <= set(model) or set(model) - names:
            raise ValueError(f"{source}: model {model!r} must hold c1, c2, c3 (and optionally "
                             f"{', '.join(sorted(names - {'c1', 'c2', 'c3'}))})")
        for key, value in model.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{source}: model coefficient {key} = {value!r} is not a finite number")
        if not isinstance(data["batch"], int) or data["batch"] < 1:
            raise ValueError(f"{source}: batch {data['batch']!r} is not a positive integer")
        data["model"] = LatencyModel(**{k: float(v) for k, v in model.items()})
        forward = data.get("forward") or {}
        if "w" not in model and forward.get("bulk_times_per_context"):
            # a profile written before the pass price: its many-row forwards give it (nothing is measured again)
            w, w_n, _ = pass_price(forward["bulk_rows"], forward["bulk_contexts"], forward["bulk_times_per_context"])
            data["model"] = dataclasses.replace(data["model"], w=w, w_n=w_n)
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
            return cls.from_json(f.read(), source=f"latency profile {os.fspath(path)}")

    def matches(self, config: ModelConfig, batch: int, device: Optional[str] = None) -> bool:
        """Same device, same model config (all fields) and same batch size."""
        return (self.device == (device or device_name()) and self.batch == int(batch)
                and self.config == config_fields(config))


def device_name(device=None) -> str:
    device = device or jax.devices()[0]
    return f"{device.platform}:{device.device_kind}"


def config_fields(config: ModelConfig) -> dict:
    return json.loads(json.dumps(config.to_dict()))  # JSON-normalised (tuples become lists)


def effective_context(config: ModelConfig, lengths, capacity: int) -> float:
    """The ``n`` at which to evaluate ``t_attn`` during decoding: the cache capacity for the
    ``xla`` backend (it reads every slot), the mean valid length for the Pallas kernels."""
    if backend_of(config).reads_full_capacity:
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
    from jaxspec.models.layers import attention_sublayer, default_positions, embed, lm_head, mlp_sublayer, rope_tables
    from jaxspec.models.params import init_params

    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup={warmup} and repeats={repeats} must be >= 1 (warm-up compiles)")
    contexts = [int(n) for n in contexts]
    if len(contexts) < 2 or min(contexts) < 1:
        raise ValueError(f"need >= 2 positive context lengths; got {contexts}")
    one_layer = config.replace(num_layers=1)
    key = jax.random.PRNGKey(seed)
    k_params, k_h, k_cache = jax.random.split(key, 3)
    params = init_params(one_layer, k_params)
    layer = params.layers[0]
    dtype = config.jnp_dtype
    h = jax.random.normal(k_h, (batch, 1, config.hidden_size), jnp.float32).astype(dtype)

    @jax.jit
    def attn_fn(layer, h, cache_k, cache_v, lengths):
        cos, sin = rope_tables(config, default_positions(lengths, h.shape[1]))
        return attention_sublayer(layer, h, config, cos, sin, cache_k, cache_v, lengths).hidden

    mlp_fn = jax.jit(lambda layer, h: mlp_sublayer(layer, h, config))

    @jax.jit
    def token_fn(outer, tokens, h):
        # the forward's embedding and LM head; the embedding row is added to the (random) hidden
        # state so the lookup is not dead code
        return jnp.argmax(lm_head(outer, h + embed(outer, tokens, config), config), axis=-1)

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
    outer = params.replace(layers=())
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
                          config_name=config.name, config=config_fields(config), batch=int(batch),
                          contexts=contexts, attn_times=attn_times, mlp_time=mlp_time, attn_samples=attn_samples,
                          mlp_samples=mlp_samples, model=model, repeats=repeats, warmup=warmup,
                          token_time=token_time, token_samples=token_samples, verify_rows=rows if rows >= 2 else 0,
                          verify_times=verify_times)


# ---------------------------------------------------------------------------- forward profiler
def skippable_sublayers(num_layers: int) -> int:
    """Attention (and MLP) sub-layers a KnapSpec draft may skip: layers ``1 .. L-2``."""
    return max(0, int(num_layers) - 2)


def forward_skip_masks(num_layers: int, half: bool = False) -> Dict[str, np.ndarray]:
    """The ``[L, 2]`` skip masks of the forward profile: ``full`` (nothing skipped), ``noattn``
    (every skippable Attention), ``nomlp`` (every skippable MLP). ``half``: ``noattn`` / ``nomlp``
    skip every second skippable sub-layer of their kind instead (layers 1, 3, 5, ...; ceil(S / 2) of
    them), the size of the plans the DP makes (docs/methods.md §4.1)."""
    L = int(num_layers)
    full = np.zeros((L, 2), bool)
    noattn, nomlp = full.copy(), full.copy()
    layers = slice(1, L - 1, 2 if half else 1)
    noattn[layers, 0] = True
    nomlp[layers, 1] = True
    return {"full": full, "noattn": noattn, "nomlp": nomlp}


def fit_method(static_masks: bool = False, half_masks: bool = False) -> str:
    """The profile ``method`` of a forward fit: ``forward[-static][-half]``."""
    return "forward" + ("-static" if static_masks else "") + ("-half" if half_masks else "")


def fit_forward(contexts: Sequence[float], full: Sequence[float], noattn: Sequence[float],
                nomlp: Sequence[float], num_layers: int, *, verify_rows: Sequence[int] = (),
                verify_times: Sequence[float] = (), verify_context: Optional[float] = None,
                skipped: Optional[int] = None) -> Tuple[LatencyModel, Dict[str, Any]]:
    """:class:`LatencyModel` from whole-forward times (see the module docstring for the formulas).

    ``full`` / ``noattn`` / ``nomlp``: seconds per decode step at each of ``contexts``;
    ``verify_times[i]``: seconds of the full model on ``verify_rows[i]`` rows at
    ``verify_context`` (default: the largest context). Returns ``(model, fit)`` where ``fit``
    holds the per-context derived sub-layer times, the unclamped ``c1 / c0 / v`` and which were
    clamped at 0 (noise can make a difference of two measured steps negative). ``skipped``: how many
    sub-layers ``noattn`` / ``nomlp`` each skip (default all ``S = L - 2``; the half masks skip
    ``ceil(S / 2)``): a sub-layer is priced at the saving of those masks divided by it."""
    L = int(num_layers)
    S_all = skippable_sublayers(L)
    if S_all < 1:
        raise ValueError(f"num_layers={L}: a forward fit needs >= 3 layers (layers 0 and L-1 are never skipped)")
    S = S_all if skipped is None else int(skipped)
    if not 1 <= S <= S_all:
        raise ValueError(f"skipped={skipped}: the profiled masks skip 1..{S_all} sub-layers of each kind")
    n = np.asarray(contexts, np.float64).reshape(-1)
    arrays = {name: np.asarray(x, np.float64).reshape(-1) for name, x in
              (("full", full), ("noattn", noattn), ("nomlp", nomlp))}
    for name, x in arrays.items():
        if x.shape != n.shape:
            raise ValueError(f"{name}: {x.size} times for {n.size} contexts")
        if not np.all(np.isfinite(x)) or np.any(x <= 0):
            raise ValueError(f"{name} times must be positive and finite; got {x.tolist()}")
    mlp_per_n = (arrays["full"] - arrays["nomlp"]) / S
    attn_per_n = (arrays["full"] - arrays["noattn"]) / S
    c1_raw = float(mlp_per_n.mean())
    c1 = max(0.0, c1_raw)
    if n.size < 2 or np.unique(n).size < 2:
        raise ValueError(f"need at least two distinct context lengths to fit t_attn(n) = c2 n + c3; got {n.tolist()}")
    (c2, c3), *_ = np.linalg.lstsq(np.stack([n, np.ones_like(n)], axis=1), attn_per_n, rcond=None)
    c2, c3 = float(c2), float(c3)
    residual = arrays["full"] - L * (c1 + c2 * n + c3)
    c0_n = 0.0
    if S < S_all:
        # prices from masks that skip part of a kind leave part of each sub-layer's cost unpriced, and
        # that part grows with the context like attention does: the remainder is a line in n
        (c0_raw, c0_n), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), residual, rcond=None)
        c0_raw, c0_n = float(c0_raw), float(c0_n)
    else:
        c0_raw = float(residual.mean())
    c0 = max(0.0, c0_raw)
    fit: Dict[str, Any] = {"skippable": S_all, "skipped": S, "t_mlp_per_context": mlp_per_n.tolist(),
                           "t_attn_per_context": attn_per_n.tolist(), "c0_per_context": residual.tolist(),
                           "c1_raw": c1_raw, "c0_raw": c0_raw, "c0_n": c0_n, "v_raw": 0.0, "clamped": []}
    v, a = 0.0, 1.0
    rows = np.asarray(verify_rows, np.float64).reshape(-1)
    times = np.asarray(verify_times, np.float64).reshape(-1)
    if rows.shape != times.shape:
        raise ValueError(f"verify_rows ({rows.size}) and verify_times ({times.size}) differ in length")
    if rows.size:
        if np.unique(rows).size < 2 or rows.min() < 1:
            raise ValueError(f"verify_rows {rows.tolist()}: need >= 2 distinct row counts >= 1")
        if not np.all(np.isfinite(times)) or np.any(times <= 0):
            raise ValueError(f"verify times must be positive and finite; got {times.tolist()}")
        n_verify = float(n.max() if verify_context is None else verify_context)
        step = float(L * (c1 + c2 * n_verify + c3) + c0 + c0_n * n_verify)
        extra = rows - 1.0
        if not np.any(extra > 0):
            raise ValueError(f"verify_rows {rows.tolist()}: need a row count > 1")
        # T_verify(g + 1) / t_step = 1 + v g, anchored at the modelled step (least squares in v): the
        # planner's verification cost t_step (1 + v g), so any gap between the verifier's one-row
        # forward and the draft-form step is absorbed where it matters, at the gammas measured
        v_anchored = float(np.sum(extra * (times / step - 1.0)) / np.sum(extra * extra))
        (intercept, slope), *_ = np.linalg.lstsq(np.stack([np.ones_like(rows), extra], axis=1), times, rcond=None)
        # the target's forwards (verification; plain decoding) have their own intercept: the
        # one-row target forward is ``a`` draft-form steps (no skip mask, no conditionals)
        a_raw, v_raw = float(intercept) / step, float(slope) / step
        a = a_raw if a_raw > 0 else float(times.min()) / step
        v = max(0.0, v_raw)
        fit.update(v_raw=v_raw, a_raw=a_raw, v_anchored_at_step=v_anchored, verify_context=n_verify,
                   verify_intercept=float(intercept), verify_slope_per_row=float(slope),
                   t_step_at_verify_context=step, verify_one_row_over_step=float(intercept) / step)
    fit["clamped"] = [name for name, raw in (("c1", c1_raw), ("c0", c0_raw), ("v", fit["v_raw"])) if raw < 0]
    if fit.get("a_raw", 1.0) <= 0:
        fit["clamped"].append("a")
    return LatencyModel(c1=c1, c2=c2, c3=c3, c0=c0, v=v, a=a, c0_n=c0_n), fit


def bulk_row_cost(rows: Sequence[int], times: Sequence[float]) -> float:
    """``u``: the least-squares slope of forward time against row count (seconds per row; unclamped)."""
    return bulk_line(rows, times)[1]


def bulk_line(rows: Sequence[int], times: Sequence[float]) -> Tuple[float, float]:
    """``(intercept, slope)``: the least-squares line of forward time against row count (unclamped)."""
    r = np.asarray(rows, np.float64).reshape(-1)
    t = np.asarray(times, np.float64).reshape(-1)
    if r.shape != t.shape or np.unique(r).size < 2:
        raise ValueError(f"bulk rows {r.tolist()} and times {t.tolist()}: need >= 2 distinct row counts, one time each")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"bulk times must be positive and finite; got {t.tolist()}")
    (intercept, slope), *_ = np.linalg.lstsq(np.stack([np.ones_like(r), r], axis=1), t, rcond=None)
    return float(intercept), float(slope)


def pass_price(bulk_rows: Sequence[int], bulk_contexts: Sequence[int],
               times_per_context: Sequence[Sequence[float]]) -> Tuple[float, float, List[str]]:
    """``(w, w_n, clamped)``: the many-row forwards' intercept line ``w + w_n n`` (:meth:`LatencyModel.t_pass`)
    through the intercepts at the profiled contexts, clamped as :func:`row_price_line` clamps the slopes;
    ``(0, 0, [])`` without many-row forwards."""
    if not bulk_rows or not bulk_contexts:
        return 0.0, 0.0, []
    intercepts = [bulk_line(bulk_rows, times)[0] for times in times_per_context]
    w, w_n, clamped = row_price_line(bulk_contexts, intercepts)
    return w, w_n, [{"u": "w", "u_n": "w_n"}[c] for c in clamped]


def bulk_profile_contexts(contexts: Sequence[int], bulk_rows: Sequence[int]) -> List[int]:
    """The contexts the many-row forwards are timed at: the smallest profiled context above the most
    rows and the largest (one of them when they coincide; none without bulk rows)."""
    if not bulk_rows:
        return []
    above = [int(n) for n in sorted(contexts) if int(n) > max(bulk_rows)]
    if not above:
        return []
    return sorted({above[0], above[-1]})


def row_price_line(contexts: Sequence[int], slopes: Sequence[float]) -> Tuple[float, float, List[str]]:
    """``(u, u_n, clamped)``: the line ``u + u_n n`` through the per-row slopes measured at one or two
    contexts. A slope below 0 counts as 0 (``"u"`` clamped); a price that falls with the context
    (noise: a row never reads less at a longer context) is replaced by the larger slope at every
    context (``"u_n"`` clamped, the dearer prediction)."""
    if len(contexts) != len(slopes) or len(slopes) not in (1, 2):
        raise ValueError(f"need one or two (context, slope) pairs; got contexts {list(contexts)}, slopes {list(slopes)}")
    clamped = ["u"] if min(slopes) < 0 else []
    s = [max(0.0, float(x)) for x in slopes]
    if len(s) == 1:
        return s[0], 0.0, clamped
    (n_lo, n_hi), (s_lo, s_hi) = contexts, s
    if n_hi <= n_lo:
        raise ValueError(f"contexts {list(contexts)} must increase")
    u_n = (s_hi - s_lo) / float(n_hi - n_lo)
    if u_n < 0:
        return max(s), 0.0, clamped + ["u_n"]
    return s_lo - u_n * float(n_lo), u_n, clamped


def call_overhead(short_step: float, long_step: float, short: int, long: int) -> float:
    """Fixed seconds per call of a loop timed at two call lengths: ``short_step`` / ``long_step`` are
    seconds per step of calls of ``short`` / ``long`` steps; the step is the slope
    ``(long * long_step - short * short_step) / (long - short)`` and the call's fixed cost what a short
    call spends beyond ``short`` of them. Clipped to ``[0, short * short_step / 2]``: noise never
    makes a call cheaper than its steps, nor leaves a step at less than half of what it measured."""
    if not 0 < short < long:
        raise ValueError(f"call lengths {short} and {long}: need 0 < short < long")
    slope = (long * float(long_step) - short * float(short_step)) / (long - short)
    return float(min(max(0.0, short * (float(short_step) - slope)), short * float(short_step) / 2))


def forward_loop_fn(params, cache, tokens, mask, *, config, steps):
    """``steps`` forwards of ``tokens`` rows at the cache's current lengths (every step writes
    the same slots), each fed the previous step's greedy tokens so the steps run in order."""
    from jaxspec.models.llama import forward

    start = cache.lengths

    def body(_, carry):
        cache, tokens = carry
        out = forward(params, tokens, cache.with_lengths(start), config=config, skip_mask=mask)
        return out.cache.with_lengths(start), jnp.argmax(out.logits, axis=-1).astype(jnp.int32)

    cache, tokens = jax.lax.fori_loop(0, steps, body, (cache, tokens))
    return tokens, cache


forward_loop = jax.jit(forward_loop_fn, static_argnames=("config", "steps"), donate_argnames=("cache",))
#: the same loop with the mask compiled in (a frozen ``((attn, mlp), ...)`` tuple or ``None``)
forward_loop_static = jax.jit(forward_loop_fn, static_argnames=("config", "steps", "mask"), donate_argnames=("cache",))


def forward_contexts(n_max: int, points: int = 4) -> List[int]:
    """Context lengths for the forward profile: ``points`` up to ``n_max`` (at least 1024)."""
    top = max(int(n_max), 1024)
    return sorted({int(x) for x in np.linspace(max(64, top // 16), top, points).round()})


def profile_latency_forward(config: ModelConfig, batch: int = 1, contexts: Sequence[int] = DEFAULT_CONTEXTS, *,
                            params=None, warmup: int = 2, repeats: int = 5, seed: int = 0,
                            verify_rows: Sequence[int] = DEFAULT_VERIFY_ROWS, steps_per_call: int = 4,
                            bulk_rows: Sequence[int] = DEFAULT_BULK_ROWS,
                            timer: Optional[Callable[[tuple, Callable[[], Any]], float]] = None,
                            static_masks: bool = False, half_masks: bool = False,
                            long_steps_per_call: Optional[int] = None) -> LatencyProfile:
    """Measure ``T_full / T_noattn / T_nomlp`` at each context and ``T_verify(r)`` at the largest,
    on whole forwards of the model (``params``, default random ones of ``config``), and fit them
    with :func:`fit_forward`. Each timed call runs ``steps_per_call`` forwards in one jitted
    ``fori_loop`` (the cache carried and donated, as in the decode loop); a point is the median
    of ``repeats`` calls after ``warmup`` untimed ones (compile happens there), divided by
    ``steps_per_call``. The variants of one context (full / noattn / nomlp; the verification
    row counts) are timed round-robin, so load drift on a shared machine does not bias their
    differences. ``timer(key, call) -> seconds of one call`` replaces the clock (tests; it is
    called for the warm-up rounds too); ``key`` is ``(kind, n, rows, steps)`` with kind
    ``full | noattn | nomlp | verify | bulk | plain`` and ``steps`` the forwards in the call.
    ``long_steps_per_call`` (default ``4 * steps_per_call``; 0: off): the full forward (and the decode loop)
    is timed at this call length too, at every context, so each call's fixed cost -- dispatch, the host
    waiting for the result, whatever a call does once -- is measured, ``o = C_short - s (C_long - C_short) /
    (l - s)``, and taken off every variant's step at that context (docs/methods.md §4.1): the decode
    loops the engine runs pay it once per stretch, not once per step, and a fit that keeps it prices
    every step (plain decoding's most of all) too dear. ``bulk_rows``: row counts of the full model's forwards
    whose least-squares slope is the price of one more row at scale, timed at the largest context and
    at the smallest one above the most rows; the line through the two slopes is ``u + u_n n``
    (:meth:`LatencyModel.t_row`; one context: ``u_n = 0``; ``()``: not measured, both 0).
    ``static_masks``: each mask compiled into its own loop (method ``"forward-static"``) instead of the
    dynamic mask's conditionals (``"forward"``). ``half_masks``: ``noattn`` / ``nomlp`` skip every second
    skippable sub-layer (:func:`forward_skip_masks`; method ``"forward[-static]-half"``), the size of the
    plans the DP makes."""
    from jaxspec.models.cache import init_cache
    from jaxspec.models.llama import freeze_skip_mask

    if warmup < 1 or repeats < 1 or steps_per_call < 1:
        raise ValueError(f"warmup={warmup}, repeats={repeats} and steps_per_call={steps_per_call} must be >= 1")
    long_steps = 4 * int(steps_per_call) if long_steps_per_call is None else int(long_steps_per_call)
    if long_steps and long_steps <= steps_per_call:
        raise ValueError(f"long_steps_per_call={long_steps_per_call}: must exceed steps_per_call={steps_per_call} "
                         f"(or be 0: no per-call cost measured)")
    contexts = sorted({int(n) for n in contexts})
    rows_list = sorted({int(r) for r in verify_rows})
    if rows_list and (len(rows_list) < 2 or rows_list[0] < 1):
        raise ValueError(f"verify_rows={list(verify_rows)}: need >= 2 distinct positive row counts (or none)")
    top_rows = max(rows_list + [1])
    if len(contexts) < 2 or contexts[0] <= top_rows:
        raise ValueError(f"need >= 2 context lengths above {top_rows} (the most verification rows); got {contexts}")
    bulk_list = sorted({int(r) for r in bulk_rows})
    if bulk_list and (len(bulk_list) < 2 or bulk_list[0] < 1):
        raise ValueError(f"bulk_rows={list(bulk_rows)}: need >= 2 distinct positive row counts (or none)")
    if bulk_list and contexts[-1] <= bulk_list[-1]:
        raise ValueError(f"bulk_rows={list(bulk_rows)}: the largest context {contexts[-1]} must exceed the most rows "
                         f"{bulk_list[-1]} (or pass bulk_rows=())")
    L = config.num_layers
    if skippable_sublayers(L) < 1:
        raise ValueError(f"{config.name}: num_layers={L}; the forward profile needs >= 3 layers")
    if params is None:
        from jaxspec.models.params import init_params

        params = init_params(config, jax.random.PRNGKey(seed))
    raw_masks = forward_skip_masks(L, half=half_masks)
    skipped = int(raw_masks["noattn"][:, 0].sum())
    masks = {k: freeze_skip_mask(m) if static_masks else jnp.asarray(m) for k, m in raw_masks.items()}
    steps = int(steps_per_call)
    loop = forward_loop_static if static_masks else forward_loop  # the mask compiled in, or a traced operand
    if timer is None:
        def timer(key, call):
            start = time.perf_counter()
            jax.block_until_ready(call())
            return time.perf_counter() - start

    def round_robin(calls):
        """Seconds per forward of each ``(key, call)``, timed round-robin (warm-up rounds first), so a
        change in the machine's load hits every variant alike and their differences stay sound."""
        out = {key: [] for key, _ in calls}
        for round_ in range(warmup + repeats):
            for key, call in calls:
                seconds = float(timer(key, call))
                if round_ >= warmup:
                    out[key].append(seconds / key[3])
        return out

    def measure(group, cache, plain=False):
        """Time the ``(key, tokens, mask)`` of ``group`` in ``forward_loop``; with ``plain``, also the
        decode loop plain decoding runs (``decode_loop``: ``steps`` greedy steps from the cache's
        lengths, which are then restored), key ``("plain", n, 1)``: its ratio to the full step is ``p``."""
        from jaxspec.decoding.autoregressive import decode_loop
        from jaxspec.decoding.sampling import SamplingConfig

        state = {"cache": cache}

        def caller(tokens, mask, k):
            def call():
                out, state["cache"] = loop(params, state["cache"], tokens, mask=mask, config=config, steps=k)
                return out
            return call

        calls = [(key, caller(tokens, mask, key[3])) for key, tokens, mask in group]
        if plain:
            start = jnp.copy(cache.lengths)  # the loop donates the cache (lengths too)
            logits = jnp.zeros((batch, config.vocab_size), jnp.float32)

            def plain_caller(k):
                def plain_call():
                    out, after = decode_loop(params, state["cache"], logits, jax.random.PRNGKey(0), config=config,
                                             sampling=SamplingConfig(), max_new_tokens=k + 1, stop_tokens=())
                    state["cache"] = after.with_lengths(jnp.copy(start))  # a fresh buffer: the next call donates it
                    return out
                return plain_call

            for k in sorted(lengths, reverse=True):
                calls.insert(0, (("plain", group[0][0][1], 1, k), plain_caller(k)))
        return round_robin(calls), state["cache"]

    lengths = (steps, long_steps) if long_steps else (steps,)
    samples: Dict[str, List[List[float]]] = {"full": [], "noattn": [], "nomlp": []}
    long_samples: List[List[float]] = []  # the full forward's step in calls of long_steps
    overhead: List[float] = []  # each context's fixed seconds per call (0 where not measured)
    verify_samples: List[List[float]] = []
    plain_samples: Dict[str, List[float]] = {}
    one = jnp.zeros((batch, 1), jnp.int32)
    for n in contexts:
        # the cache holds exactly n slots (the xla backend reads them all), n - top_rows of them valid
        cache = init_cache(config, batch, n, lengths=jnp.full((batch,), n - top_rows, jnp.int32))
        group = [((kind, n, 1, steps), one, masks[kind]) for kind in ("full", "noattn", "nomlp")]
        if long_steps:
            group.append((("full", n, 1, long_steps), one, masks["full"]))
        got, cache = measure(group, cache)
        for kind in ("full", "noattn", "nomlp"):
            samples[kind].append(got[(kind, n, 1, steps)])
        if long_steps:
            long_samples.append(got[("full", n, 1, long_steps)])
            o = call_overhead(statistics.median(samples["full"][-1]), statistics.median(long_samples[-1]), steps,
                              long_steps)
            # nor more than half of the cheapest variant's call (a noisy slope never leaves a step <= 0)
            overhead.append(min(o, steps * min(statistics.median(samples[k][-1]) for k in samples) / 2))
        else:
            overhead.append(0.0)
        if n == contexts[-1] and rows_list:
            got, cache = measure([(("verify", n, r, steps), jnp.zeros((batch, r), jnp.int32), None)
                                  for r in rows_list], cache)
            verify_samples = [got[("verify", n, r, steps)] for r in rows_list]
        if n == contexts[-1] and top_rows >= steps:
            got, cache = measure([(("full", n, 1, k), one, masks["full"]) for k in lengths], cache, plain=True)
            plain_samples = {"plain": got[("plain", n, 1, steps)], "full": got[("full", n, 1, steps)]}
            if long_steps:
                plain_samples.update(plain_long=got[("plain", n, 1, long_steps)],
                                     full_long=got[("full", n, 1, long_steps)])
        del cache
    bulk_contexts = bulk_profile_contexts(contexts, bulk_list)
    bulk_samples_per_context: List[List[List[float]]] = []
    for n in bulk_contexts:
        cache = init_cache(config, batch, n, lengths=jnp.full((batch,), n - bulk_list[-1], jnp.int32))
        got, cache = measure([(("bulk", n, r, steps), jnp.zeros((batch, r), jnp.int32), None) for r in bulk_list],
                             cache)
        bulk_samples_per_context.append([got[("bulk", n, r, steps)] for r in bulk_list])
        del cache
    bulk_med_per_context = [[statistics.median(s) for s in per] for per in bulk_samples_per_context]
    bulk_samples = bulk_samples_per_context[-1] if bulk_list else []
    bulk_med = bulk_med_per_context[-1] if bulk_list else []
    raw_med = {k: [statistics.median(s) for s in v] for k, v in samples.items()}
    # each call's fixed cost off every variant's step at its context (the decode loops pay it per stretch)
    med = {k: [t - o / steps for t, o in zip(v, overhead)] for k, v in raw_med.items()}
    raw_verify_med = [statistics.median(s) for s in verify_samples]
    # the same per-call cost off each verification call, never more than half of it: a noisy slope (a loaded
    # machine) must not leave a verification time <= 0, which the fit refuses
    verify_med = [t - min(overhead[-1] / steps, t / 2) for t in raw_verify_med]
    model, fit = fit_forward(contexts, med["full"], med["noattn"], med["nomlp"], L, verify_rows=rows_list,
                             verify_times=verify_med, verify_context=contexts[-1], skipped=skipped)
    if bulk_list:
        slopes = [bulk_row_cost(bulk_list, med_n) for med_n in bulk_med_per_context]
        u, u_n, clamped = row_price_line(bulk_contexts, slopes)
        fit.update(u_raw=slopes[-1], u_per_context=slopes, u_at=float(u), u_n=float(u_n))
        fit["clamped"].extend(clamped)
        w, w_n, clamped = pass_price(bulk_list, bulk_contexts, bulk_med_per_context)
        fit.update(w=float(w), w_n=float(w_n))
        fit["clamped"].extend(clamped)
        model = dataclasses.replace(model, u=u, u_n=u_n, w=w, w_n=w_n)
    if plain_samples:
        plain_med = statistics.median(plain_samples["plain"])
        full_med = statistics.median(plain_samples["full"])
        if long_steps:  # both loops' steps without their calls' fixed costs (each its own)
            plain_long, full_long = statistics.median(plain_samples["plain_long"]), statistics.median(
                plain_samples["full_long"])
            fit.update(plain_call_overhead=call_overhead(plain_med, plain_long, steps, long_steps),
                       plain_full_call_overhead=call_overhead(full_med, full_long, steps, long_steps))
            plain_med -= fit["plain_call_overhead"] / steps
            full_med -= fit["plain_full_call_overhead"] / steps
        # the ratio to the full step timed beside it, carried onto the fitted step (as a is); a fitted
        # step that is not positive (a noisy fit of a tiny model) leaves p unmeasured (a stands in)
        fitted = model.t_step(contexts[-1], L)
        model = dataclasses.replace(model, p=float(plain_med / full_med) * float(med["full"][-1] / fitted)
                                    if fitted > 0 and full_med > 0 else 0.0)
        fit.update(plain_step=plain_med, plain_full_step=full_med, plain_over_full=plain_med / full_med)
    forward = {"steps_per_call": steps, "long_steps_per_call": long_steps, "times": med, "raw_times": raw_med,
               "samples": samples, "long_samples": long_samples, "call_overhead": overhead,
               "verify_context": contexts[-1], "verify_rows": rows_list, "verify_times": verify_med,
               "raw_verify_times": raw_verify_med, "verify_samples": verify_samples,
               "bulk_rows": bulk_list, "bulk_times": bulk_med, "bulk_samples": bulk_samples,
               "bulk_contexts": bulk_contexts, "bulk_times_per_context": bulk_med_per_context,
               "bulk_samples_per_context": bulk_samples_per_context, "plain_samples": plain_samples, "fit": fit,
               "static_masks": bool(static_masks), "half_masks": bool(half_masks),
               "skipped_layers": [int(i) for i in np.flatnonzero(raw_masks["noattn"][:, 0])],
               "how": "whole forwards (jaxspec.models.llama.forward, "
                      + ("each skip mask compiled in, as a plan compiled for itself" if static_masks else
                         "dynamic skip mask as the KnapSpec draft")
                      + ("; the skip masks skip every second skippable sub-layer of a kind" if half_masks else "")
                      + "; verification without a mask) in a jitted fori_loop carrying the donated cache; plain "
                        "decoding: decode_loop itself, beside the full forward, at the largest context"
                      + (f"; each call's fixed cost (the full forward timed at {steps} and {long_steps} steps a call) "
                         "taken off every step" if long_steps else "")}
    return LatencyProfile(device=device_name(), platform=jax.devices()[0].platform, jax_version=jax.__version__,
                          config_name=config.name, config=config_fields(config), batch=int(batch),
                          contexts=contexts, attn_times=fit["t_attn_per_context"], mlp_time=model.c1,
                          attn_samples=[[t] for t in fit["t_attn_per_context"]],
                          mlp_samples=fit["t_mlp_per_context"], model=model, repeats=repeats, warmup=warmup,
                          token_time=model.c0, token_samples=fit["c0_per_context"],
                          verify_rows=top_rows if len(rows_list) >= 2 else 0,
                          verify_times={f"rows_{r}": t for r, t in zip(rows_list, verify_med)},
                          method=fit_method(static_masks, half_masks), forward=forward)


PROFILERS = {"isolated": profile_latency, "forward": profile_latency_forward,
             "forward-static": functools.partial(profile_latency_forward, static_masks=True),
             "forward-half": functools.partial(profile_latency_forward, half_masks=True),
             "forward-static-half": functools.partial(profile_latency_forward, static_masks=True, half_masks=True)}


def set_aside_path(path) -> str:
    """Where :func:`load_or_profile` keeps a profile it measures again (``remeasure``):
    ``<stem>.replaced-<UTC time>.json`` next to it (a counter is added if that exists too)."""
    stem, ext = os.path.splitext(os.fspath(path))
    base = f"{stem}.replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    candidate, n = base + ext, 1
    while os.path.exists(candidate):
        candidate, n = f"{base}-{n}{ext}", n + 1
    return candidate


def load_or_profile(path, config: ModelConfig, batch: int = 1, *, profile_fn: Optional[Callable] = None,
                    method: str = "isolated", remeasure: bool = False, **profile_kwargs) -> LatencyProfile:
    """Reuse the profile at ``path`` if it was measured on this device for this config and batch
    (and with this ``method``); otherwise measure (``profile_fn(config, batch, **profile_kwargs)``,
    default the profiler of ``method``) and save it there.

    A saved profile does not record which code it timed: after a change to the forward, pass
    ``remeasure=True`` to measure again whatever the file holds. The old file is then renamed
    (:func:`set_aside_path`) once the new profile is measured, never overwritten; a failed
    measurement leaves it in place.

    A file of an older format, or measured for another device, config or batch, is measured again
    and renamed the same way; a file that cannot be parsed, or that holds the other fit ``method``,
    is an error naming the file and the value (it is not overwritten)."""
    if method not in FIT_METHODS:
        raise ValueError(f"latency fit method {method!r} is not one of {list(FIT_METHODS)}")
    profile_fn = profile_fn or PROFILERS[method]
    if remeasure:
        profile = profile_fn(config, batch, **profile_kwargs)
        if path is not None:
            if os.path.exists(os.fspath(path)):
                os.replace(os.fspath(path), set_aside_path(path))
            profile.save(path)
        return profile
    if path is not None and os.path.exists(os.fspath(path)):
        try:
            profile = LatencyProfile.load(path)
        except ProfileFormatError:
            profile = None
        except (ValueError, TypeError) as err:
            raise ValueError(f"{err}; delete or move the file to measure it again") from err
        if profile is not None and profile.method != method:
            raise ValueError(f"latency profile {os.fspath(path)} holds a fit of method {profile.method!r}, "
                             f"not the requested {method!r}; pass another file or the matching method")
        if (profile is not None and profile.method.startswith("forward")
                and not {"bulk_rows", "bulk_contexts"} <= set(profile.forward)
                and profile_kwargs.get("bulk_rows", DEFAULT_BULK_ROWS)):
            profile = None  # measured before the row price per context existed: measure again (the DP's cost needs it)
        if profile is not None and profile.method.startswith("forward") and "plain_samples" not in profile.forward:
            profile = None  # measured before the decode loop's own step was timed: measure again
        if (profile is not None and profile.method.startswith("forward") and "long_steps_per_call" not in profile.forward
                and profile_kwargs.get("long_steps_per_call", None) != 0):
            profile = None  # measured before each call's fixed cost was taken off its steps: measure again
        if profile is not None and profile.matches(config, batch):
            return profile
    profile = profile_fn(config, batch, **profile_kwargs)
    if path is not None:
        if os.path.exists(os.fspath(path)):  # an older format or another device / config / batch: kept aside
            os.replace(os.fspath(path), set_aside_path(path))
        profile.save(path)
    return profile
