"""Minimal pure-JAX reproducer of the hang behind pallas-tpu-interpret under a host mesh (docs/tpu.md).

``jax.experimental.io_callback`` inside ``shard_map`` on >= 2 CPU devices, receiving a > 100 KiB
argument, never returns (JAX 0.10.2): ``io_callback_impl`` stages the arguments on CPU device 0
(``device_put``), a host-to-device copy over 100 KiB is asynchronous, and reading it
(``np.array``) waits forever while device 0 runs its shard of the same program. With device 0
outside the mesh it finishes::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 N=1000000 timeout 60 python experiments/repro/io_callback_device0_hang.py  # hangs
    XLA_FLAGS=--xla_force_host_platform_device_count=3 SKIP=1 N=1000000 python experiments/repro/io_callback_device0_hang.py  # ok
    XLA_FLAGS=--xla_force_host_platform_device_count=2 N=1024 python experiments/repro/io_callback_device0_hang.py  # ok (small)
"""
import faulthandler
import os

faulthandler.dump_traceback_later(40, exit=True)  # print the blocked threads and exit
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from jax.experimental import io_callback
n = int(os.environ.get("N", "65536"))
SKIP = int(os.environ.get("SKIP", "0"))  # leave the first SKIP devices out of the mesh


def cb(x):
    return np.asarray(np.array(x).sum(), np.float32)  # blocks here (PyArray_bf_getbuffer -> Future::Await)


mesh = jax.sharding.Mesh(np.array(jax.devices()[SKIP:]), ("t",))
def f(x):
    y = io_callback(cb, jax.ShapeDtypeStruct((), jnp.float32), x * 2)
    return x + y
g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("t"), out_specs=P("t"), check_vma=False))
x = jax.device_put(jnp.ones(((jax.device_count() - SKIP) * n,), jnp.float32), jax.sharding.NamedSharding(mesh, P("t")))
print(float(g(x).sum()), flush=True)
print("ok", n, flush=True)
