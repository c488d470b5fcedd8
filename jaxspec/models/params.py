"""The model's parameters, declared once.

Every parameter array is described by one :class:`ArrayInfo` (shape, dtype, logical axes,
initialiser) in :func:`layer_info` / :func:`model_info`. Everything else derives from that
declaration:

* :func:`init_params` -- random parameters (tests, paper-shape benchmarks);
* :func:`expected_param_shapes` / :func:`check_param_shapes` -- checkpoint and call-time shape checks;
* :func:`logical_axes` -- the logical axis names the sharding rules map onto a mesh
  (:mod:`jaxspec.models.sharding`);
* :func:`num_params` -- the parameter count (``ModelConfig.num_params``).

The parameters are registered dataclass pytrees, :class:`ModelParams` holding a tuple of
:class:`LayerParams`; ``bq/bk/bv`` are ``None`` without attention bias and ``lm_head`` is
``None`` with tied embeddings (``None`` is an empty pytree: ``jax.tree.map`` skips it).

Layout (``d`` hidden size, ``F`` MLP hidden size, ``Hq``/``Hkv`` query/KV heads of ``D``,
``V`` vocabulary): weights are ``[in, out]`` (``x @ w``), head axes flattened head-major.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig

LogicalAxes = Tuple[Optional[str], ...]
#: ``init(key, shape, dtype, scale) -> array``
Initialiser = Callable[[jax.Array, Tuple[int, ...], Any, float], jax.Array]


def normal_init(std: Optional[float] = None) -> Initialiser:
    """Gaussian of standard deviation ``std`` (``None``: the ``scale`` given to :func:`init_params`)."""
    def init(key, shape, dtype, scale):
        return ((scale if std is None else std) * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return init


def norm_init(key, shape, dtype, scale):
    """RMSNorm weights near one (``1 + 0.1 * N(0, 1)``), so tests exercise the weight."""
    return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Declaration of one parameter array: ``shape``, ``dtype``, ``logical_axes`` (one name per
    dimension, see :class:`jaxspec.parallel.ShardingRules`) and its initialiser."""

    shape: Tuple[int, ...]
    dtype: Any
    logical_axes: LogicalAxes
    init: Initialiser

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _is_info(x) -> bool:
    return isinstance(x, ArrayInfo)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """One decoder layer: pre-attention norm ``[d]``, ``wq [d, Hq*D]``, ``wk/wv [d, Hkv*D]``,
    ``wo [Hq*D, d]``, biases ``bq [Hq*D]``, ``bk/bv [Hkv*D]`` (or ``None``), pre-MLP norm ``[d]``,
    ``w_gate/w_up [d, F]``, ``w_down [F, d]``.

    The fused layout (:func:`fuse_projections`) holds the same numbers as ``wqkv [d, (Hq + 2 Hkv) D]``
    (columns: q, then k, then v), ``bqkv`` and ``w_gate_up [d, 2F]`` (gate, then up), with ``wq/wk/wv``,
    ``bq/bk/bv`` and ``w_gate/w_up`` ``None``: one matrix product where there were three, and one where
    there were two (docs/methods.md §2, fused projections)."""

    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    bq: Any
    bk: Any
    bv: Any
    mlp_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    wqkv: Any = None
    bqkv: Any = None
    w_gate_up: Any = None

    @property
    def fused(self) -> bool:
        """True in the fused layout (:func:`fuse_projections`)."""
        return self.wqkv is not None

    def replace(self, **changes) -> "LayerParams":
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelParams:
    """Embedding table ``[V, d]``, the layers, final norm ``[d]`` and ``lm_head [d, V]``
    (``None`` when tied to the embedding)."""

    embed: Any
    layers: Tuple[LayerParams, ...]
    final_norm: Any
    lm_head: Any

    @property
    def head(self) -> jax.Array:
        """The LM-head matrix ``[d, V]`` (the transposed embedding when tied)."""
        return self.embed.T if self.lm_head is None else self.lm_head

    def replace(self, **changes) -> "ModelParams":
        return dataclasses.replace(self, **changes)


LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerParams))
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelParams))

# the order the random initialiser draws keys in (kept so random weights are the same as before
# the declarative layout: the norms and matrices first, the optional biases last)
_LAYER_INIT_ORDER = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv")


# ---------------------------------------------------------------------------- the declaration
def layer_info(config: ModelConfig, fused: bool = False) -> LayerParams:
    """The :class:`ArrayInfo` of every parameter of one layer (the one layout declaration);
    ``fused``: the fused layout of :func:`fuse_projections` (its fused columns carry the logical axes
    ``"qkv"`` and ``"mlp2"``, which no sharding rule maps: the fused layout is for one device)."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    dtype, norm_dtype = config.jnp_dtype, jnp.float32
    weight = normal_init()

    def bias(size, axis):
        return ArrayInfo((size,), dtype, (axis,), weight) if config.attention_bias else None

    if fused:
        return LayerParams(
            attn_norm=ArrayInfo((d,), norm_dtype, ("embed",), norm_init),
            wq=None, wk=None, wv=None,
            wo=ArrayInfo((q, d), dtype, ("q_heads", "embed"), weight),
            bq=None, bk=None, bv=None,
            mlp_norm=ArrayInfo((d,), norm_dtype, ("embed",), norm_init),
            w_gate=None, w_up=None,
            w_down=ArrayInfo((f, d), dtype, ("mlp", "embed"), weight),
            wqkv=ArrayInfo((d, q + 2 * kv), dtype, ("embed", "qkv"), weight),
            bqkv=bias(q + 2 * kv, "qkv"),
            w_gate_up=ArrayInfo((d, 2 * f), dtype, ("embed", "mlp2"), weight),
        )
    return LayerParams(
        attn_norm=ArrayInfo((d,), norm_dtype, ("embed",), norm_init),
        wq=ArrayInfo((d, q), dtype, ("embed", "q_heads"), weight),
        wk=ArrayInfo((d, kv), dtype, ("embed", "kv_heads"), weight),
        wv=ArrayInfo((d, kv), dtype, ("embed", "kv_heads"), weight),
        wo=ArrayInfo((q, d), dtype, ("q_heads", "embed"), weight),
        bq=bias(q, "q_heads"),
        bk=bias(kv, "kv_heads"),
        bv=bias(kv, "kv_heads"),
        mlp_norm=ArrayInfo((d,), norm_dtype, ("embed",), norm_init),
        w_gate=ArrayInfo((d, f), dtype, ("embed", "mlp"), weight),
        w_up=ArrayInfo((d, f), dtype, ("embed", "mlp"), weight),
        w_down=ArrayInfo((f, d), dtype, ("mlp", "embed"), weight),
    )


def model_info(config: ModelConfig, fused: bool = False) -> ModelParams:
    """The :class:`ArrayInfo` of every parameter of the model (a :class:`ModelParams` of them);
    ``fused``: the layers in the fused layout (:func:`fuse_projections`)."""
    d, v = config.hidden_size, config.vocab_size
    layer = layer_info(config, fused)
    return ModelParams(
        embed=ArrayInfo((v, d), config.jnp_dtype, ("vocab_in", "embed"), normal_init(1.0)),
        layers=(layer,) * config.num_layers,
        final_norm=ArrayInfo((d,), jnp.float32, ("embed",), norm_init),
        lm_head=None if config.tie_word_embeddings else ArrayInfo((d, v), config.jnp_dtype, ("embed", "vocab"),
                                                                  normal_init()),
    )


# ---------------------------------------------------------------------------- derived: init, shapes, axes, counts
def init_params(config: ModelConfig, key: jax.Array, scale: float = 0.02) -> ModelParams:
    """Random parameters with the real layout (for tests and paper-shape benchmarks)."""
    info = model_info(config)
    keys = iter(jax.random.split(key, 14 * config.num_layers + 4))

    def draw(item: ArrayInfo):
        return item.init(next(keys), item.shape, item.dtype, scale)

    layers = []
    for layer in info.layers:
        drawn = {name: draw(getattr(layer, name)) for name in _LAYER_INIT_ORDER if getattr(layer, name) is not None}
        layers.append(LayerParams(**{name: drawn.get(name) for name in LAYER_FIELDS}))
    embed = draw(info.embed)
    final_norm = draw(info.final_norm)
    lm_head = None if info.lm_head is None else draw(info.lm_head)
    return ModelParams(embed=embed, layers=tuple(layers), final_norm=final_norm, lm_head=lm_head)


def abstract_params(config: ModelConfig) -> ModelParams:
    """``jax.ShapeDtypeStruct`` of every parameter (no arrays allocated)."""
    return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), model_info(config), is_leaf=_is_info)


def logical_axes(config: ModelConfig) -> ModelParams:
    """A :class:`ModelParams` whose leaves are the logical axis tuples of each parameter."""
    return jax.tree.map(lambda i: i.logical_axes, model_info(config), is_leaf=_is_info)


def num_params(config: ModelConfig) -> int:
    """Parameter count (embeddings, and an untied head, included once each)."""
    return int(sum(i.size for i in jax.tree.leaves(model_info(config), is_leaf=_is_info)))


def param_count(params) -> int:
    """Number of scalars in a parameter pytree."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def param_bytes(params) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------- flat ``{path: array}`` form
def flatten_params(params) -> Dict[str, Any]:
    """``ModelParams`` (of arrays, shapes, infos ...) -> ``{"embed": .., "layers.3.wq": .., ...}``
    (``None`` entries left out). The checkpoint converters and orbax files use this form."""
    flat = {}
    for name in MODEL_FIELDS:
        if name == "layers":
            for i, layer in enumerate(params.layers):
                for leaf in LAYER_FIELDS:
                    value = getattr(layer, leaf)
                    if value is not None:
                        flat[f"layers.{i}.{leaf}"] = value
        elif getattr(params, name) is not None:
            flat[name] = getattr(params, name)
    return flat


def expected_param_shapes(config: ModelConfig, fused: bool = False) -> Dict[str, Tuple[int, ...]]:
    """``{path: shape}`` of every parameter, used by the loaders to validate checkpoints (``fused``: of
    the fused layout)."""
    return {path: item.shape for path, item in flatten_params(model_info(config, fused)).items()}


def unflatten_params(flat: Dict[str, Any], config: ModelConfig) -> ModelParams:
    """Inverse of :func:`flatten_params` for ``config`` (the caller has validated the keys)."""
    layers = tuple(LayerParams(**{leaf: flat.get(f"layers.{i}.{leaf}") for leaf in LAYER_FIELDS})
                   for i in range(config.num_layers))
    return ModelParams(embed=flat.get("embed"), layers=layers, final_norm=flat.get("final_norm"),
                       lm_head=flat.get("lm_head"))


def cast_params(params: ModelParams, config: ModelConfig) -> ModelParams:
    """Cast every parameter to its declared dtype (``config.dtype``; norm weights float32)."""
    return jax.tree.map(lambda info, x: jnp.asarray(x, info.dtype), model_info(config, is_fused(params)), params,
                        is_leaf=_is_info)


def check_param_shapes(params, config: ModelConfig) -> None:
    """Raise ``ValueError`` naming the first parameter whose presence or shape does not match
    ``config`` (static: reads shapes only, so it is free inside ``jit``)."""
    if not isinstance(params, ModelParams):
        raise ValueError(f"params must be a jaxspec.models.params.ModelParams, got {type(params).__name__}; "
                         f"build them with init_params or jaxspec.models.loading.load_model")
    if len(params.layers) != config.num_layers:
        raise ValueError(f"params have {len(params.layers)} layers; config {config.name!r} has {config.num_layers}")
    fused = bool(params.layers) and params.layers[0].fused
    if any(layer.fused != fused for layer in params.layers):
        raise ValueError("params mix the fused and the separate projection layout across layers; "
                         "use fuse_projections / unfuse_projections on the whole model")
    expected = expected_param_shapes(config, fused)
    got = {path: tuple(np.shape(x)) for path, x in flatten_params(params).items()}
    for path in list(expected) + [p for p in got if p not in expected]:  # declaration order
        if path not in got:
            raise ValueError(f"parameter {path!r} is missing; config {config.name!r} expects shape {expected[path]}")
        if path not in expected:
            raise ValueError(f"parameter {path!r} (shape {got[path]}) is not part of config {config.name!r} "
                             f"(attention_bias={config.attention_bias}, tie_word_embeddings="
                             f"{config.tie_word_embeddings})")
        if got[path] != tuple(expected[path]):
            raise ValueError(f"parameter {path!r} has shape {got[path]}; config {config.name!r} expects "
                             f"{tuple(expected[path])}")


# ---------------------------------------------------------------------------- fused projections
def fuse_projections(params: ModelParams) -> ModelParams:
    """The same model with each layer's q/k/v projections as one matrix ``wqkv`` (and their biases as
    ``bqkv``) and the MLP's gate and up projections as one ``w_gate_up`` (docs/methods.md §2, fused projections).

    Every forward runs one matrix product where it ran three, and one where it ran two: fewer, larger
    kernels per layer on a GPU, the same bytes read. The numbers are the same; the products' sums may
    round differently in the last place, so compare outputs of one layout with each other. For one
    device: :func:`jaxspec.models.sharding.shard_params` refuses the fused layout (a column split of
    ``wqkv`` would not follow the heads). Already fused params come back as they are. The separate
    arrays are dropped from the result (the caller's ``params`` keep theirs): delete the caller's
    reference to free them. :func:`unfuse_projections` is the inverse."""
    if not isinstance(params, ModelParams):
        raise ValueError(f"fuse_projections: params must be a ModelParams, got {type(params).__name__}")

    def fuse(layer: LayerParams) -> LayerParams:
        if layer.fused:
            return layer
        bias = None if layer.bq is None else jnp.concatenate([layer.bq, layer.bk, layer.bv])
        return layer.replace(wqkv=jnp.concatenate([layer.wq, layer.wk, layer.wv], axis=1), bqkv=bias,
                             w_gate_up=jnp.concatenate([layer.w_gate, layer.w_up], axis=1),
                             wq=None, wk=None, wv=None, bq=None, bk=None, bv=None, w_gate=None, w_up=None)

    return params.replace(layers=tuple(fuse(layer) for layer in params.layers))


def unfuse_projections(params: ModelParams, config: ModelConfig) -> ModelParams:
    """The inverse of :func:`fuse_projections` (exact: the columns are split back); separate params come
    back as they are. Needed before saving or sharding fused params."""
    q, kv, f = (config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                config.intermediate_size)

    def unfuse(layer: LayerParams) -> LayerParams:
        if not layer.fused:
            return layer
        if layer.wqkv.shape[-1] != q + 2 * kv or layer.w_gate_up.shape[-1] != 2 * f:
            raise ValueError(f"unfuse_projections: wqkv has {layer.wqkv.shape[-1]} columns and w_gate_up "
                             f"{layer.w_gate_up.shape[-1]}; config {config.name!r} expects {q + 2 * kv} and {2 * f}")
        wq, wk, wv = jnp.split(layer.wqkv, [q, q + kv], axis=1)
        biases = (None,) * 3 if layer.bqkv is None else tuple(jnp.split(layer.bqkv, [q, q + kv]))
        w_gate, w_up = jnp.split(layer.w_gate_up, [f], axis=1)
        return layer.replace(wq=wq, wk=wk, wv=wv, bq=biases[0], bk=biases[1], bv=biases[2], w_gate=w_gate,
                             w_up=w_up, wqkv=None, bqkv=None, w_gate_up=None)

    return params.replace(layers=tuple(unfuse(layer) for layer in params.layers))


def is_fused(params) -> bool:
    """True when ``params`` (a :class:`ModelParams`) are in the fused layout."""
    return isinstance(params, ModelParams) and bool(params.layers) and params.layers[0].fused


__all__ = ["ArrayInfo", "LayerParams", "ModelParams", "LAYER_FIELDS", "MODEL_FIELDS", "abstract_params",
           "cast_params", "check_param_shapes", "expected_param_shapes", "flatten_params", "fuse_projections",
           "init_params", "is_fused", "layer_info", "logical_axes", "model_info", "norm_init", "normal_init",
           "num_params", "param_bytes", "param_count", "unflatten_params", "unfuse_projections"]
