"""Multi-device execution mechanics: a ``(data, tensor)`` mesh, logical axis names and the one
rules table mapping them onto the mesh. This package knows meshes and logical axes only; the
model's arrays, their placement and the per-device memory planner live in
:mod:`jaxspec.models.sharding` and :mod:`jaxspec.models.memory`:

    mesh = jaxspec.parallel.parse_mesh("data=2,tensor=4")
    params = jaxspec.models.sharding.shard_params(params, config, mesh)   # then generate(...) unchanged
"""

from jaxspec.parallel.sharding import (MESH_AXES, RULES, LogicalAxes, ShardingRules, active_mesh, axis_size,
                                       constrain, initialize_distributed, make_mesh, mesh_of, mesh_shape, parse_mesh,
                                       parse_mesh_shape, per_device_kernel, place_array, use_mesh)

__all__ = [name for name in dir() if not name.startswith("_")]
