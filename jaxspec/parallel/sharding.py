"""Tensor and data parallelism: logical axis names, ONE rules table, mesh helpers, placement.

This module knows meshes and logical axes only; which array has which logical axes is
declared by the model (:mod:`jaxspec.models.params`, :mod:`jaxspec.models.cache`) and placed
by :mod:`jaxspec.models.sharding`.

Every array the library holds has *logical* axis names (``"batch"``, ``"kv_heads"``,
``"mlp"``, ...). One table, :class:`ShardingRules`, maps each logical name to a mesh axis
(``"data"`` or ``"tensor"``) or to ``None`` (replicated). The mesh has two axes:

* ``"data"`` -- batch rows (KV-cache batch axis, tokens, logits); weights are replicated over it;
* ``"tensor"`` -- query/KV heads (``wq/wk/wv`` columns, ``wo`` rows, ``bq/bk/bv``, the cache
  ``Hkv`` axis), the MLP hidden dimension (``w_gate/w_up`` columns, ``w_down`` rows) and the
  ``lm_head`` vocabulary columns (logits come out vocabulary-sharded).

Embeddings and norms are replicated. Placement is explicit (``jaxspec.models.sharding``:
``shard_params``, ``shard_cache``, ``cache_shardings``); inside ``jit`` GSPMD propagates the shardings
of the inputs, so the model and decoding code are the same functions as on one device.

The head axes are flattened in the weights (``wq [d, Hq * D]``, head-major), so sharding the
flattened axis in ``n`` contiguous blocks gives every device whole heads exactly when the head
count divides by ``n``; ``jaxspec.models.sharding.check_divisible`` enforces that with a clear error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Dict, Iterator, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: The mesh axes, outermost first (``data`` spans hosts first; ``tensor`` stays within a host).
MESH_AXES = ("data", "tensor")

MeshAxis = Optional[str]
LogicalAxes = Tuple[Optional[str], ...]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The one map from logical axis names to mesh axes (``None`` = replicated).

    ===========  =========  ==============================================================
    logical      mesh axis  where
    ===========  =========  ==============================================================
    batch        data       cache ``[B, ...]``, tokens, hidden states, logits
    sequence     --         cache slots ``S``, token positions ``T``
    embed        --         model width ``d`` (hidden states, weight rows/columns, norms)
    q_heads      tensor     ``wq`` columns / ``wo`` rows (``Hq * D``), ``bq``
    kv_heads     tensor     ``wk``/``wv`` columns, ``bk``/``bv``, cache ``Hkv`` axis
    head_dim     --         ``D`` inside a head
    mlp          tensor     ``w_gate``/``w_up`` columns, ``w_down`` rows
    vocab        tensor     ``lm_head`` columns and the logits' last axis (untied heads)
    vocab_in     --         embedding-table rows (a gather: kept whole on every device)
    lengths      --         cache ``lengths [B]`` (tiny; replicated so every host can read it)
    ===========  =========  ==============================================================
    """

    batch: MeshAxis = "data"
    sequence: MeshAxis = None
    embed: MeshAxis = None
    q_heads: MeshAxis = "tensor"
    kv_heads: MeshAxis = "tensor"
    head_dim: MeshAxis = None
    mlp: MeshAxis = "tensor"
    vocab: MeshAxis = "tensor"
    vocab_in: MeshAxis = None
    lengths: MeshAxis = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value not in MESH_AXES:
                raise ValueError(f"ShardingRules.{field.name}={value!r}; valid mesh axes: {MESH_AXES} or None")

    def mesh_axis(self, logical: Optional[str]) -> MeshAxis:
        if logical is None:
            return None
        valid = [f.name for f in dataclasses.fields(self)]
        if logical not in valid:
            raise ValueError(f"unknown logical axis {logical!r}; valid: {valid}")
        return getattr(self, logical)

    def spec(self, logical_axes: Sequence[Optional[str]]) -> PartitionSpec:
        """``("batch", "kv_heads", "sequence", "head_dim")`` -> ``P("data", "tensor", None, None)``."""
        return PartitionSpec(*(self.mesh_axis(name) for name in logical_axes))

    def sharding(self, mesh: Mesh, logical_axes: Sequence[Optional[str]]) -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical_axes))

    def table(self) -> Dict[str, MeshAxis]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


#: The default (and only built-in) rules table.
RULES = ShardingRules()

# ---------------------------------------------------------------------------- meshes
def make_mesh(data: int = 1, tensor: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    """A ``(data, tensor)`` mesh over ``devices`` (default: all devices of all processes).

    ``tensor`` is the inner (fastest-varying) axis, so tensor-parallel groups are neighbouring
    devices (one host's NVLink domain); ``data`` spans hosts. Axes are ``Auto`` (GSPMD).
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("data", data), ("tensor", tensor)):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh axis {name}={size!r} must be a positive integer")
    if data * tensor != len(devices):
        raise ValueError(f"mesh data={data} x tensor={tensor} = {data * tensor} devices, but {len(devices)} "
                         f"device(s) are available ({devices[0].platform}); the product must equal the device count")
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, tensor), MESH_AXES, axis_types=auto, devices=devices)


_MESH_ITEM = re.compile(r"^\s*(data|tensor)\s*=\s*(-?\d+)\s*$")


def parse_mesh_shape(spec: str) -> Dict[str, int]:
    """``"data=2,tensor=4"`` -> ``{"data": 2, "tensor": 4}`` (an omitted axis has size 1)."""
    shape = {"data": 1, "tensor": 1}
    seen = set()
    if not spec or not spec.strip():
        raise ValueError("empty mesh spec; example: 'data=2,tensor=4'")
    for item in spec.split(","):
        match = _MESH_ITEM.match(item)
        if not match:
            raise ValueError(f"bad mesh item {item!r} in {spec!r}; expected AXIS=SIZE with AXIS in {MESH_AXES}, "
                             f"e.g. 'data=2,tensor=4'")
        axis, size = match.group(1), int(match.group(2))
        if axis in seen:
            raise ValueError(f"mesh axis {axis!r} given twice in {spec!r}")
        if size < 1:
            raise ValueError(f"mesh axis {axis}={size} in {spec!r} must be >= 1")
        seen.add(axis)
        shape[axis] = size
    return shape


def parse_mesh(spec: str, devices: Optional[Sequence] = None) -> Mesh:
    """``parse_mesh("data=2,tensor=4")``: :func:`make_mesh` from a command-line spec."""
    shape = parse_mesh_shape(spec)
    return make_mesh(shape["data"], shape["tensor"], devices)


def mesh_shape(mesh: Mesh) -> Dict[str, int]:
    return {name: int(size) for name, size in mesh.shape.items()}


def axis_size(mesh_or_shape, axis: MeshAxis) -> int:
    """Size of mesh ``axis`` (1 for ``None``) of a :class:`Mesh` or a ``{"data": D, "tensor": T}`` dict."""
    if axis is None:
        return 1
    shape = mesh_or_shape if isinstance(mesh_or_shape, dict) else mesh_shape(mesh_or_shape)
    if axis not in shape:
        raise ValueError(f"mesh axis {axis!r} not in the mesh {shape}; jaxspec meshes have axes {MESH_AXES}")
    return shape[axis]


# ---------------------------------------------------------------------------- placement
def place_array(x, sharding: NamedSharding):
    """``x`` placed with ``sharding``; on several hosts every process holds the same full value
    and keeps only its devices' blocks."""
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)  # one process, or an array already global: a reshard
    # multi-host: every process holds the same full value; each keeps only its devices' blocks
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def mesh_of(tree) -> Optional[Mesh]:
    """The mesh the first ``NamedSharding`` leaf of ``tree`` lives on (``None``: not on a mesh)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


# ---------------------------------------------------------------------------- inside jit
def active_mesh():
    """The mesh set by :func:`use_mesh` / ``jax.set_mesh`` (an ``AbstractMesh`` inside jit), or ``None``."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def constrain(x, logical_axes: Sequence[Optional[str]], rules: ShardingRules = RULES):
    """``with_sharding_constraint`` by logical names under the active mesh; a no-op without one
    (the single-device trace is unchanged)."""
    mesh = active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(logical_axes)))


@contextlib.contextmanager
def use_mesh(mesh: Optional[Mesh]) -> Iterator[Optional[Mesh]]:
    """``jax.set_mesh(mesh)`` for the duration (nothing when ``mesh`` is ``None``).

    The decoding entry points enter it themselves (``mesh=`` argument, or the mesh of the
    sharded params); wrap direct ``forward`` calls in it when the attention backend is Pallas,
    so the kernels run per device inside ``shard_map``.
    """
    if mesh is None:
        yield None
        return
    with jax.set_mesh(mesh):
        yield mesh


def per_device_kernel(kernel, queries, k_cache, v_cache, rows, rules: ShardingRules = RULES):
    """``kernel(queries [B, Hkv, M, D], k_cache, v_cache [B, Hkv, S, D], rows [B, ...])`` returning
    arrays ``[B, Hkv, ...]`` (flash-decoding partials), run per device under the active mesh.

    GSPMD cannot split a Pallas call (on GPU it is an opaque custom call, in interpret mode a
    loop of dynamic slices): it would gather the whole cache onto every device. Inside
    ``shard_map`` each device runs the kernel on its own ``[B/data, Hkv/tensor, S, D]`` blocks,
    with no communication (batch rows and KV heads are independent). An axis whose size does not
    divide the dimension is left whole (per device the kernel then sees that full axis).
    Without an active mesh this is ``kernel(...)``: the single-device trace is unchanged.
    """
    mesh = active_mesh()
    if mesh is None:
        return kernel(queries, k_cache, v_cache, rows)
    sizes = dict(mesh.shape)

    def axis_for(logical, count):
        axis = rules.mesh_axis(logical)
        return axis if axis is not None and axis in sizes and count % sizes[axis] == 0 else None

    batch_axis = axis_for("batch", k_cache.shape[0])
    kv_axis = axis_for("kv_heads", k_cache.shape[1])
    blocks = PartitionSpec(batch_axis, kv_axis)
    per_row = PartitionSpec(batch_axis)
    out_shapes = jax.eval_shape(kernel, queries, k_cache, v_cache, rows)
    out_specs = jax.tree.map(lambda _: blocks, out_shapes)
    mapped = jax.shard_map(kernel, mesh=mesh, in_specs=(blocks, blocks, blocks, per_row), out_specs=out_specs,
                           check_vma=False)
    return mapped(queries, k_cache, v_cache, rows)


def initialize_distributed(**kwargs) -> int:
    """Join a multi-host job: ``jax.distributed.initialize(**kwargs)`` (on SLURM, Open MPI and
    Cloud TPU the coordinator, process count and id are detected from the environment; else pass
    ``coordinator_address``, ``num_processes``, ``process_id``). Call before anything touches a
    device. Returns this process's index (0 writes the results)."""
    jax.distributed.initialize(**kwargs)
    return jax.process_index()
