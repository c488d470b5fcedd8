"""Per-device memory plan: weights and KV caches under the sharding rules, checked before allocation.

``plan_memory(config, context=, batch=, mesh=)`` counts, per device, the bytes of

* the target weights (every parameter divided by the mesh axes its rule shards it over:
  ``wq/wk/wv/wo``, biases, the MLP and an untied ``lm_head`` over ``tensor``; embeddings and
  norms whole on every device; norms are float32, everything else ``config.dtype``);
* the target KV cache ``2 * L * B/data * Hkv/tensor * S * D`` (+ the replicated lengths);
* optionally a separate draft's weights and KV cache (``draft_config``); its cache has the
  full ``context`` slots, or ``draft_budget`` slots for a MagicDec-style bounded draft KV.

It counts what the library allocates and keeps, not the transient working set of a step
(activations, float32 scores, logits, XLA scratch): leave headroom for those with
``check(device_bytes, reserve_bytes=...)``. Nothing is allocated: the plan reads shapes only.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Union

import numpy as np

import jax

from jaxspec.config import ModelConfig
from jaxspec.models.attention import backend_of
from jaxspec.models.cache import CACHE_KV_AXES, CACHE_LENGTHS_AXES
from jaxspec.models.params import ArrayInfo, model_info
from jaxspec.models.sharding import check_divisible
from jaxspec.parallel.sharding import RULES, ShardingRules, mesh_shape, parse_mesh_shape

GiB = 1 << 30

MeshLike = Union[str, Dict[str, int], tuple, "jax.sharding.Mesh"]  # noqa: F821


class MemoryPlanError(ValueError):
    """The planned per-device bytes exceed the device memory."""


def _mesh_dict(mesh: MeshLike) -> Dict[str, int]:
    if isinstance(mesh, str):
        return parse_mesh_shape(mesh)
    if isinstance(mesh, tuple):
        if len(mesh) != 2:
            raise ValueError(f"mesh shape {mesh}; expected (data, tensor)")
        return {"data": int(mesh[0]), "tensor": int(mesh[1])}
    if isinstance(mesh, dict):
        shape = {"data": 1, "tensor": 1}
        unknown = set(mesh) - set(shape)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid: data, tensor")
        shape.update({k: int(v) for k, v in mesh.items()})
        return shape
    return mesh_shape(mesh)


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def _per_device_elements(shape, logical, mesh: Dict[str, int], rules: ShardingRules) -> int:
    count = 1
    for size, name in zip(shape, logical):
        axis = rules.mesh_axis(name)
        count *= size // (mesh[axis] if axis is not None else 1)
    return count


def weight_bytes_per_device(config: ModelConfig, mesh: MeshLike, rules: ShardingRules = RULES) -> int:
    """Bytes of ``config``'s parameters on one device under ``rules`` (norms float32)."""
    mesh = _mesh_dict(mesh)
    check_divisible(config, mesh, rules)
    infos = jax.tree.leaves(model_info(config), is_leaf=lambda x: isinstance(x, ArrayInfo))
    return int(sum(_per_device_elements(info.shape, info.logical_axes, mesh, rules) * np.dtype(info.dtype).itemsize
                   for info in infos))


def cache_bytes_per_device(config: ModelConfig, batch: int, capacity: int, mesh: MeshLike,
                           rules: ShardingRules = RULES, dtype: Optional[str] = None) -> int:
    """Bytes of one KV cache ``[B, Hkv, S, D]`` x 2 x layers (+ lengths) on one device.

    ``capacity`` is rounded up to the attention backend's capacity multiple, as ``init_cache`` does.
    """
    mesh = _mesh_dict(mesh)
    check_divisible(config, mesh, rules, batch=batch)
    capacity = backend_of(config).round_capacity(capacity)
    shape = (batch, config.num_kv_heads, capacity, config.head_dim)
    per_buffer = _per_device_elements(shape, CACHE_KV_AXES, mesh, rules) * _itemsize(dtype or config.dtype)
    lengths = _per_device_elements((batch,), CACHE_LENGTHS_AXES, mesh, rules) * 4
    return int(2 * config.num_layers * per_buffer + lengths)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of everything jaxspec allocates and keeps for one generation."""

    model: str
    mesh: Dict[str, int]
    context: int
    batch: int
    weights: int
    target_cache: int
    draft_model: Optional[str] = None
    draft_weights: int = 0
    draft_cache: int = 0
    draft_capacity: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.target_cache + self.draft_weights + self.draft_cache

    @property
    def num_devices(self) -> int:
        return int(np.prod(list(self.mesh.values())))

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}

    def describe(self) -> str:
        parts = [f"weights {self.weights / GiB:.2f} GiB", f"target KV {self.target_cache / GiB:.2f} GiB"]
        if self.draft_model is not None:
            parts += [f"draft weights {self.draft_weights / GiB:.2f} GiB",
                      f"draft KV ({self.draft_capacity} slots) {self.draft_cache / GiB:.2f} GiB"]
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.items())
        return (f"{self.model}: context {self.context}, batch {self.batch}, mesh {mesh} -> per device "
                f"{' + '.join(parts)} = {self.total / GiB:.2f} GiB ({self.total:,} B)")

    def check(self, device_bytes: int, reserve_bytes: int = 0) -> "MemoryPlan":
        """Raise :class:`MemoryPlanError` (with the numbers) unless ``total + reserve_bytes``
        fits in ``device_bytes``; returns the plan so calls chain."""
        needed = self.total + int(reserve_bytes)
        if needed > device_bytes:
            reserve = f" + reserve {reserve_bytes / GiB:.2f} GiB" if reserve_bytes else ""
            cache_share = (self.target_cache + self.draft_cache) / max(self.total, 1)
            raise MemoryPlanError(
                f"does not fit: needs {needed / GiB:.2f} GiB ({needed:,} B) per device > device memory "
                f"{device_bytes / GiB:.2f} GiB ({device_bytes:,} B); {self.describe()}{reserve}. "
                f"The KV caches are {cache_share:.0%} of it; "
                f"per-device KV shrinks with a larger tensor axis (KV heads) or data axis (batch rows), and "
                f"with a smaller batch or context; weights shrink with a larger tensor axis")
        return self


def plan_memory(config: ModelConfig, *, context: int, batch: int, mesh: MeshLike = (1, 1),
                rules: ShardingRules = RULES, draft_config: Optional[ModelConfig] = None,
                draft_budget: Optional[int] = None, draft_rules: Optional[ShardingRules] = None,
                cache_dtype: Optional[str] = None) -> MemoryPlan:
    """Per-device memory of ``config`` (+ a separate draft) at ``context`` cache slots per row.

    ``context`` is the cache capacity (prompt + new tokens, + gamma + 2 for speculative
    decoding); ``mesh`` a :class:`~jax.sharding.Mesh`, ``{"data": D, "tensor": T}``,
    ``(D, T)`` or ``"data=D,tensor=T"``; ``draft_budget`` bounds the draft KV slots (default:
    ``context``). Raises the same divisibility errors ``shard_params`` would.
    """
    if context < 1 or batch < 1:
        raise ValueError(f"context={context} and batch={batch} must be positive")
    shape = _mesh_dict(mesh)
    plan = dict(model=config.name, mesh=shape, context=int(context), batch=int(batch),
                weights=weight_bytes_per_device(config, shape, rules),
                target_cache=cache_bytes_per_device(config, batch, context, shape, rules, cache_dtype))
    if draft_config is not None:
        draft_rules = draft_rules or rules
        draft_capacity = int(draft_budget or context)
        plan.update(draft_model=draft_config.name, draft_capacity=draft_capacity,
                    draft_weights=weight_bytes_per_device(draft_config, shape, draft_rules),
                    draft_cache=cache_bytes_per_device(draft_config, batch, draft_capacity, shape, draft_rules,
                                                       cache_dtype))
    elif draft_budget is not None:
        raise ValueError("draft_budget needs a draft_config (a self-draft shares the target's cache)")
    return MemoryPlan(**plan)


def device_memory_bytes(device=None) -> Optional[int]:
    """The memory limit of ``device`` (default: the first device), or ``None`` where the backend
    does not report one (CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 -- backends without memory stats raise various errors
        return None
    if not stats:
        return None
    return stats.get("bytes_limit")
