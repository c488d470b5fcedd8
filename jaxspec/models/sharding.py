"""Placement of the model's parameters and KV caches on a ``(data, tensor)`` mesh.

The logical axes of every parameter come from its declaration (:mod:`jaxspec.models.params`),
those of the cache from :mod:`jaxspec.models.cache`; :class:`jaxspec.parallel.ShardingRules`
maps logical axes to mesh axes. The mesh mechanics (making meshes, ``use_mesh``,
``constrain``, per-device kernels) are :mod:`jaxspec.parallel`'s and are re-exported here
so one import serves a caller.

    from jaxspec.models.sharding import parse_mesh, shard_params
    mesh = parse_mesh("data=2,tensor=4")
    params = shard_params(params, config, mesh)          # then call generate(...) unchanged
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import jax
from jax.sharding import Mesh

from jaxspec.config import ModelConfig
from jaxspec.models.cache import (CACHE_KV_AXES, CACHE_LENGTHS_AXES, KVCache, allocate_cache,  # noqa: F401
                                  cache_shardings, check_cache_divisible)
from jaxspec.models.params import ModelParams, check_param_shapes, is_fused, logical_axes
from jaxspec.parallel.sharding import (MESH_AXES, RULES, LogicalAxes, ShardingRules, active_mesh,  # noqa: F401
                                       axis_size, constrain, initialize_distributed, make_mesh, mesh_of, mesh_shape,
                                       parse_mesh, parse_mesh_shape, place_array, use_mesh)

#: Logical axes of the forward's activations (for constraints and documentation).
ACTIVATION_AXES: Dict[str, LogicalAxes] = {
    "tokens": ("batch", "sequence"),  # [B, T]
    "hidden": ("batch", "sequence", "embed"),  # [B, T, d]
    "queries": ("batch", "sequence", "q_heads", "head_dim"),  # [B, T, Hq, D]
    "keys": ("batch", "sequence", "kv_heads", "head_dim"),  # [B, T, Hkv, D] (new tokens)
    "mlp_hidden": ("batch", "sequence", "mlp"),  # [B, T, F]
    "logits": ("batch", "sequence", "vocab"),  # [B, T, V]
    "output_tokens": ("lengths", None),  # [B, N] decoded tokens: replicated like lengths (host-readable)
}


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def param_logical_axes(config: ModelConfig) -> ModelParams:
    """A :class:`ModelParams` whose leaves are the logical axis tuples of each parameter."""
    return logical_axes(config)


def check_divisible(config: ModelConfig, mesh, rules: ShardingRules = RULES, batch: Optional[int] = None) -> None:
    """Raise ``ValueError`` naming the count and the mesh axis when a sharded dimension does not split.

    ``mesh`` is a :class:`Mesh` or a ``{"data": D, "tensor": T}`` dict.
    """
    checks = [
        ("q_heads", config.num_heads, "num_heads"),
        ("kv_heads", config.num_kv_heads, "num_kv_heads"),
        ("mlp", config.intermediate_size, "intermediate_size (MLP hidden)"),
        ("embed", config.hidden_size, "hidden_size"),
        ("head_dim", config.head_dim, "head_dim"),
    ]
    if not config.tie_word_embeddings:
        checks.append(("vocab", config.vocab_size, "vocab_size (lm_head columns)"))
    checks.append(("vocab_in", config.vocab_size, "vocab_size (embedding rows)"))
    if batch is not None:
        checks.append(("batch", batch, "batch size"))
    for logical, count, what in checks:
        axis = rules.mesh_axis(logical)
        size = axis_size(mesh, axis)
        if count % size:
            hint = (f"use a {axis} axis size that divides {count}" if logical != "batch" else
                    f"use a batch that is a multiple of {size}")
            raise ValueError(f"{what}={count} of {config.name!r} is not divisible by the mesh axis {axis!r} of size "
                             f"{size} (ShardingRules.{logical}={axis!r}); {hint}, or map {logical} to None in "
                             f"ShardingRules to replicate it")


def param_shardings(config: ModelConfig, mesh: Mesh, rules: ShardingRules = RULES) -> ModelParams:
    """``NamedSharding`` of every parameter of ``config`` (a :class:`ModelParams` of them)."""
    return jax.tree.map(lambda axes: rules.sharding(mesh, axes), param_logical_axes(config), is_leaf=_is_axes)


def shard_params(params: ModelParams, config: ModelConfig, mesh: Mesh, rules: ShardingRules = RULES) -> ModelParams:
    """Place ``params`` on ``mesh`` following ``rules`` (checks shapes and head/MLP/vocab divisibility first)."""
    check_param_shapes(params, config)
    if is_fused(params):
        raise ValueError("shard_params: these params are in the fused projection layout, whose columns a mesh "
                         "cannot split by heads; pass unfuse_projections(params, config) instead")
    check_divisible(config, mesh, rules)
    return jax.tree.map(place_array, params, param_shardings(config, mesh, rules))


def shard_cache(cache: KVCache, mesh: Mesh, rules: ShardingRules = RULES) -> KVCache:
    """Place a :class:`~jaxspec.models.cache.KVCache` on ``mesh`` (batch over data, KV heads over tensor)."""
    check_cache_divisible(cache.batch_size, cache.keys[0].shape[1], mesh, rules)
    return jax.tree.map(place_array, cache, cache_shardings(mesh, cache.num_layers, rules))


def rules_of(params: ModelParams, base: ShardingRules = RULES) -> ShardingRules:
    """The rules ``params`` were placed with (head, MLP and vocabulary axes read from their
    shardings; the other entries from ``base``): the cache of a model follows its weights."""
    layer = params.layers[0]

    def axis(x, dim):
        sharding = x.sharding if isinstance(x, jax.Array) else None
        spec = sharding.spec if isinstance(sharding, jax.sharding.NamedSharding) else None
        if spec is None or len(spec) <= dim:
            return None
        return spec[dim]

    changes = dict(q_heads=axis(layer.wq, 1), kv_heads=axis(layer.wk, 1), mlp=axis(layer.w_gate, 1))
    if params.lm_head is not None:
        changes["vocab"] = axis(params.lm_head, 1)
    return dataclasses.replace(base, **changes)


def placement_of(params: ModelParams) -> Tuple[Optional[Mesh], Optional[ShardingRules]]:
    """``(mesh, rules)`` of params placed by :func:`shard_params`; ``(None, None)`` if not on a mesh."""
    mesh = mesh_of(params)
    return (None, None) if mesh is None else (mesh, rules_of(params))


def resolve_placement(params: ModelParams, config: ModelConfig, mesh: Optional[Mesh] = None,
                      rules: Optional[ShardingRules] = None):
    """What the decoding entry points do with their ``mesh``/``rules`` arguments.

    * ``mesh`` given: place ``params`` with :func:`shard_params` (a no-op for arrays already
      placed that way) and use ``rules`` (default :data:`RULES`);
    * ``mesh`` None: use the mesh and rules the params already live on, or ``(params, None,
      None)`` -- the single-device path, untouched.
    """
    if mesh is None:
        mesh, inferred = placement_of(params)
        return params, mesh, (rules or inferred) if mesh is not None else None
    rules = RULES if rules is None else rules
    return shard_params(params, config, mesh, rules), mesh, rules


__all__ = ["ACTIVATION_AXES", "CACHE_KV_AXES", "CACHE_LENGTHS_AXES", "MESH_AXES", "RULES", "ShardingRules",
           "active_mesh", "allocate_cache", "cache_shardings", "check_cache_divisible", "check_divisible",
           "constrain", "initialize_distributed", "make_mesh", "mesh_of", "mesh_shape", "param_logical_axes",
           "param_shardings", "parse_mesh", "parse_mesh_shape", "placement_of", "resolve_placement", "rules_of",
           "shard_cache", "shard_params", "use_mesh"]
