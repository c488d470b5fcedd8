"""Multi-device execution: a ``(data, tensor)`` mesh, logical axis names, one rules table,
placement of params and caches, and a per-device memory planner.

    from jaxspec.parallel import parse_mesh, shard_params
    mesh = parse_mesh("data=2,tensor=4")
    params = shard_params(params, config, mesh)          # then call generate(...) unchanged
"""

from jaxspec.parallel.memory import MemoryPlan, MemoryPlanError, device_memory_bytes, plan_memory
from jaxspec.parallel.sharding import (ACTIVATION_AXES, CACHE_KV_AXES, CACHE_LENGTHS_AXES, LAYER_PARAM_AXES,
                                       MESH_AXES, PARAM_AXES, RULES, ShardingRules, active_mesh, allocate_cache,
                                       cache_shardings, check_divisible, constrain, make_mesh, mesh_of, mesh_shape,
                                       param_logical_axes, param_shardings, parse_mesh, parse_mesh_shape,
                                       initialize_distributed, per_device_kernel, placement_of, resolve_placement,
                                       rules_of, shard_cache, shard_params, use_mesh)

__all__ = [name for name in dir() if not name.startswith("_")]
