"""Tensor and data parallelism: logical axis names, ONE rules table, mesh helpers, placement.

Every array the library holds has *logical* axis names (``"batch"``, ``"kv_heads"``,
``"mlp"``, ...). One table, :class:`ShardingRules`, maps each logical name to a mesh axis
(``"data"`` or ``"tensor"``) or to ``None`` (replicated). The mesh has two axes:

* ``"data"`` -- batch rows (KV-cache batch axis, tokens, logits); weights are replicated over it;
* ``"tensor"`` -- query/KV heads (``wq/wk/wv`` columns, ``wo`` rows, ``bq/bk/bv``, the cache
  ``Hkv`` axis), the MLP hidden dimension (``w_gate/w_up`` columns, ``w_down`` rows) and the
  ``lm_head`` vocabulary columns (logits come out vocabulary-sharded).

Embeddings and norms are replicated. Placement is explicit (:func:`shard_params`,
:func:`shard_cache`, :func:`cache_shardings`); inside ``jit`` GSPMD propagates the shardings
of the inputs, so the model and decoding code are the same functions as on one device.

The head axes are flattened in the weights (``wq [d, Hq * D]``, head-major), so sharding the
flattened axis in ``n`` contiguous blocks gives every device whole heads exactly when the head
count divides by ``n``; :func:`check_divisible` enforces that with a clear error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Dict, Iterator, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.config import ModelConfig

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

# ---------------------------------------------------------------------------- logical axes of every array
#: Per-layer parameters (``params["layers"][i][name]``).
LAYER_PARAM_AXES: Dict[str, LogicalAxes] = {
    "attn_norm": ("embed",),
    "wq": ("embed", "q_heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("q_heads", "embed"),
    "bq": ("q_heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}
#: Top-level parameters.
PARAM_AXES: Dict[str, LogicalAxes] = {
    "embed": ("vocab_in", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}
#: KV cache: per-layer keys/values and the per-row lengths.
CACHE_KV_AXES: LogicalAxes = ("batch", "kv_heads", "sequence", "head_dim")
CACHE_LENGTHS_AXES: LogicalAxes = ("lengths",)
#: Activations (the names the forward's tensors have; used for constraints and documentation).
ACTIVATION_AXES: Dict[str, LogicalAxes] = {
    "tokens": ("batch", "sequence"),  # [B, T]
    "hidden": ("batch", "sequence", "embed"),  # [B, T, d]
    "queries": ("batch", "sequence", "q_heads", "head_dim"),  # [B, T, Hq, D]
    "keys": ("batch", "sequence", "kv_heads", "head_dim"),  # [B, T, Hkv, D] (new tokens)
    "mlp_hidden": ("batch", "sequence", "mlp"),  # [B, T, F]
    "logits": ("batch", "sequence", "vocab"),  # [B, T, V]
    "output_tokens": ("lengths", None),  # [B, N] decoded tokens: replicated like lengths (host-readable)
}


def param_logical_axes(params) -> dict:
    """A pytree like ``params`` whose leaves are the logical axis tuples of each parameter."""
    out = {}
    for name, value in params.items():
        if name == "layers":
            out["layers"] = [{key: _layer_axes(key) for key in layer} for layer in value]
        elif name in PARAM_AXES:
            out[name] = PARAM_AXES[name]
        else:
            raise ValueError(f"unknown parameter {name!r}; known: {sorted(PARAM_AXES) + ['layers']}")
    return out


def _layer_axes(key: str) -> LogicalAxes:
    if key not in LAYER_PARAM_AXES:
        raise ValueError(f"unknown layer parameter {key!r}; known: {sorted(LAYER_PARAM_AXES)}")
    return LAYER_PARAM_AXES[key]


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


def _axis_size(mesh_or_shape, axis: MeshAxis) -> int:
    if axis is None:
        return 1
    shape = mesh_or_shape if isinstance(mesh_or_shape, dict) else mesh_shape(mesh_or_shape)
    if axis not in shape:
        raise ValueError(f"mesh axis {axis!r} not in the mesh {shape}; jaxspec meshes have axes {MESH_AXES}")
    return shape[axis]


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
        size = _axis_size(mesh, axis)
        if count % size:
            hint = (f"use a {axis} axis size that divides {count}" if logical != "batch" else
                    f"use a batch that is a multiple of {size}")
            raise ValueError(f"{what}={count} of {config.name!r} is not divisible by the mesh axis {axis!r} of size "
                             f"{size} (ShardingRules.{logical}={axis!r}); {hint}, or map {logical} to None in "
                             f"ShardingRules to replicate it")


# ---------------------------------------------------------------------------- placement
def _place(x, sharding: NamedSharding):
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)  # one process, or an array already global: a reshard
    # multi-host: every process holds the same full value; each keeps only its devices' blocks
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def param_shardings(params, mesh: Mesh, rules: ShardingRules = RULES) -> dict:
    """``NamedSharding`` of every parameter (a pytree like ``params``)."""
    axes = param_logical_axes(params)
    return jax.tree.map(lambda logical: rules.sharding(mesh, logical), axes, is_leaf=lambda x: isinstance(x, tuple))


def shard_params(params, config: ModelConfig, mesh: Mesh, rules: ShardingRules = RULES) -> dict:
    """Place ``params`` on ``mesh`` following ``rules`` (checks head/MLP/vocab divisibility first)."""
    check_divisible(config, mesh, rules)
    shardings = param_shardings(params, mesh, rules)
    return jax.tree.map(_place, params, shardings)


def cache_shardings(mesh: Mesh, num_layers: int, rules: ShardingRules = RULES):
    """``KVCache``-shaped pytree of ``NamedSharding`` (keys/values per layer, lengths)."""
    from jaxspec.models.cache import KVCache

    kv = rules.sharding(mesh, CACHE_KV_AXES)
    return KVCache(keys=(kv,) * num_layers, values=(kv,) * num_layers,
                   lengths=rules.sharding(mesh, CACHE_LENGTHS_AXES))


def check_cache_divisible(batch: int, num_kv_heads: int, mesh, rules: ShardingRules = RULES) -> None:
    for logical, count, what in (("batch", batch, "cache batch"), ("kv_heads", num_kv_heads, "cache num_kv_heads")):
        axis = rules.mesh_axis(logical)
        size = _axis_size(mesh, axis)
        if count % size:
            hint = ("the number of rows (prompts) must be a multiple of it" if logical == "batch" else
                    "tensor parallelism splits whole KV heads")
            raise ValueError(f"{what}={count} is not divisible by the mesh axis {axis!r} of size {size} "
                             f"(ShardingRules.{logical}={axis!r}): {hint}")


def shard_cache(cache, mesh: Mesh, rules: ShardingRules = RULES):
    """Place a :class:`~jaxspec.models.cache.KVCache` on ``mesh`` (batch over data, KV heads over tensor)."""
    check_cache_divisible(cache.batch_size, cache.keys[0].shape[1], mesh, rules)
    return jax.tree.map(_place, cache, cache_shardings(mesh, cache.num_layers, rules))


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


def allocate_cache(config: ModelConfig, batch_size: int, capacity: int, mesh: Mesh,
                   rules: Optional[ShardingRules] = None, dtype=None, lengths=None):
    """An empty :class:`~jaxspec.models.cache.KVCache` created directly in its sharded layout
    (each device allocates only its ``[B/data, Hkv/tensor, S, D]`` blocks)."""
    rules = RULES if rules is None else rules
    check_cache_divisible(batch_size, config.num_kv_heads, mesh, rules)
    lengths = np.zeros((batch_size,), np.int32) if lengths is None else np.asarray(lengths, np.int32)
    return _cache_allocator(config, batch_size, capacity, dtype, mesh, rules)(lengths)


@functools.lru_cache(maxsize=64)
def _cache_allocator(config, batch_size, capacity, dtype, mesh, rules):
    from jaxspec.models.cache import init_cache

    return jax.jit(lambda lengths: init_cache(config, batch_size, capacity, dtype=dtype, lengths=lengths),
                   out_shardings=cache_shardings(mesh, config.num_layers, rules))


def rules_of(params, base: ShardingRules = RULES) -> ShardingRules:
    """The rules ``params`` were placed with (head, MLP and vocabulary axes read from their
    shardings; the other entries from ``base``): the cache of a model follows its weights."""
    layer = params["layers"][0]

    def axis(x, dim):
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        if spec is None or len(spec) <= dim:
            return None
        return spec[dim]

    changes = dict(q_heads=axis(layer["wq"], 1), kv_heads=axis(layer["wk"], 1), mlp=axis(layer["w_gate"], 1))
    if "lm_head" in params:
        changes["vocab"] = axis(params["lm_head"], 1)
    return dataclasses.replace(base, **changes)


def placement_of(params) -> Tuple[Optional[Mesh], Optional[ShardingRules]]:
    """``(mesh, rules)`` of params placed by :func:`shard_params`; ``(None, None)`` if not on a mesh."""
    mesh = mesh_of(params)
    return (None, None) if mesh is None else (mesh, rules_of(params))


def resolve_placement(params, config: ModelConfig, mesh: Optional[Mesh] = None,
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
