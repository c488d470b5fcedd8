"""Multi-device: the same functions on a (data, tensor) mesh give the single-device results.

The sharded checks need 8 devices, and the rest of the suite runs with 1: they run in ONE
subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu``) that
executes this file as a script, prints a summary table and a JSON line, and the tests below
assert on it. Meshes (data, tensor): (1, 8), tensor only, and (2, 4), both axes. Per mesh: forward (prefill and a
sparse-verification step: logits allclose in float32, caches equal), greedy autoregressive
``generate`` (tokens identical), greedy ``speculative_generate`` with ``SeparateDraft`` (tokens
and acceptance identical) and ``select_top_k`` (indices identical). On (1, 8) also the Mosaic TPU kernels (TPU
interpret mode) per device inside ``shard_map`` against their references. On (2, 4) also: a
``SelfDraft``, the KnapSpec DP (candidates, cosine values, alpha), the explicit ``mesh=`` argument, the Pallas backend (interpret mode) under the
mesh, no all-gather in the compiled forward, and the divisibility errors.

A second subprocess (``--tpu-worker``, 9 host devices, the mesh on devices 1..8: see
``_tpu_worker``) runs greedy speculative decoding and Dustin with the target on
``pallas-tpu-interpret`` under tensor = 8 against ``xla``. The two subprocesses start together
(the ``workers`` fixture) and run side by side.

The memory planner and the argument parsing run in-process (no devices needed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

MESHES = ((1, 8), (2, 4))  # tensor-parallel 8 ways, and data x tensor (each axis sharded)
REPO = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- the 8-device worker
def _worker() -> dict:  # runs in the subprocess
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxspec.config import ModelConfig
    from jaxspec.decoding.autoregressive import generate
    from jaxspec.decoding.policies import SelfDraft, SeparateDraft, parse_skip_spec
    from jaxspec.decoding.speculative import EngineConfig, speculative_generate
    from jaxspec.models.cache import init_cache
    from jaxspec.models.llama import forward_compiled, forward_jit, init_params
    from jaxspec.models.sharding import shard_cache, shard_params
    from jaxspec.parallel import make_mesh, use_mesh
    from jaxspec.dustin.selection import select_top_k

    assert jax.device_count() == 8, jax.devices()
    # GQA 16 query / 8 KV heads, MLP hidden 64, untied (vocab-sharded) head; the draft has a tied head
    target = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=16,
                         num_kv_heads=8, head_dim=8, attention_bias=True, dtype="float32", name="tiny-tp8")
    draft = target.replace(num_layers=1, tie_word_embeddings=True, name="tiny-tp8-draft")
    params = init_params(target, jax.random.PRNGKey(0), scale=0.3)
    draft_params = init_params(draft, jax.random.PRNGKey(1), scale=0.3)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 128, n).tolist() for n in (3, 9, 5, 7, 10, 4, 8, 6)]  # batch 8, ragged
    tokens = jnp.asarray(rng.randint(0, 128, (8, 12)), jnp.int32)
    step_tokens = jnp.asarray(rng.randint(0, 128, (8, 4)), jnp.int32)
    indices = jnp.asarray(rng.randint(-2, 14, (8, 6)), jnp.int32)  # padding, out of range, duplicates
    scores = jnp.asarray(np.round(rng.randn(8, 256), 1), jnp.float32)  # many ties
    score_lengths = jnp.asarray([0, 256, 3, 40, 100, 255, 17, 64], jnp.int32)
    engine = EngineConfig(gamma=3, max_new_tokens=10)
    self_policy = SelfDraft(target)
    self_state = self_policy.initial_state(parse_skip_spec("mlp:1", target.num_layers))

    def forward_pair(p, cache, config=target):
        first = forward_jit(p, tokens, cache, config=config)
        second = forward_jit(p, step_tokens, first.cache, config=config, verify_indices=indices)
        return first, second

    # single-device references
    reference = {}
    reference["forward"] = forward_pair(params, init_cache(target, 8, 64))
    reference["ar"] = generate(params, target, prompts, 10).rows()
    sd = speculative_generate(params, target, prompts, draft_policy=SeparateDraft(draft), draft_params=draft_params,
                              engine=engine)
    reference["sd"] = (sd.rows(), sd.metrics["accepted_histogram"])
    reference["topk"] = np.asarray(select_top_k(scores, score_lengths, k=32, sinks=2, window=4))
    assert reference["sd"][0] == reference["ar"]
    # KnapSpec DP (4 layers so that layers 1..2 can be skipped): prefix of 6 tokens, 4 reference tokens
    from jaxspec.knapspec.dp import boundary_states, knapsack_dp

    dp_config = target.replace(num_layers=4, name="tiny-tp8-dp")
    dp_params = init_params(dp_config, jax.random.PRNGKey(2), scale=0.3)
    dp_prefix = jnp.asarray(rng.randint(0, 128, (8, 6)), jnp.int32)
    dp_tokens = jnp.asarray(rng.randint(0, 128, (8, 4)), jnp.int32)
    prefix_len = jnp.full((8,), 6, jnp.int32)

    def run_dp(p, cache):
        cache = forward_jit(p, dp_prefix, cache, config=dp_config).cache
        states = boundary_states(p, dp_config, dp_tokens, cache, prefix_len)
        return knapsack_dp(p, dp_config, cache, prefix_len, states, w_attn=1, w_mlp=1)

    reference["dp"] = run_dp(dp_params, init_cache(dp_config, 8, 16))

    results = []

    def record(mesh_shape, case, ok, detail="", seconds=0.0):
        results.append({"mesh": list(mesh_shape), "case": case, "ok": bool(ok), "detail": str(detail),
                        "seconds": round(seconds, 2)})

    def max_diff(a, b):
        return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))

    def collectives(hlo):
        return {name: len(re.findall(name + r"(-start)?\(", hlo)) for name in ("all-gather", "all-reduce")}

    for shape in MESHES:
        mesh = make_mesh(*shape)
        sharded = shard_params(params, target, mesh)
        start = time.perf_counter()
        cache = shard_cache(init_cache(target, 8, 64), mesh)
        first, second = forward_pair(sharded, cache)
        ref_first, ref_second = reference["forward"]
        diff = max(max_diff(first.logits, ref_first.logits), max_diff(second.logits, ref_second.logits))
        cache_diff = max(max_diff(a, b) for a, b in zip(second.cache.keys + second.cache.values,
                                                         ref_second.cache.keys + ref_second.cache.values))
        layout = tuple(second.cache.keys[0].sharding.spec) + (None, None)
        expected = ("data" if shape[0] > 1 else None, "tensor" if shape[1] > 1 else None)
        scale = float(np.max(np.abs(np.asarray(ref_second.logits))))
        ok = (np.allclose(first.logits, ref_first.logits, rtol=1e-5, atol=1e-5 * scale)
              and np.allclose(second.logits, ref_second.logits, rtol=1e-5, atol=1e-5 * scale)
              and cache_diff < 1e-4 and layout[:2] == expected)
        record(shape, "forward (prefill + sparse verify)", ok, f"max |dlogits| {diff:.1e} (max |logit| {scale:.1f}), "
                                                             f"cache {cache_diff:.1e}, cache spec {layout[:2]}",
               time.perf_counter() - start)

        start = time.perf_counter()
        rows = generate(sharded, target, prompts, 10).rows()
        record(shape, "greedy AR generate", rows == reference["ar"], "", time.perf_counter() - start)

        start = time.perf_counter()
        result = speculative_generate(sharded, target, prompts, draft_policy=SeparateDraft(draft),
                                      draft_params=draft_params, engine=engine)
        same = (result.rows(), result.metrics["accepted_histogram"]) == reference["sd"]
        draft_spec = result.final_state.draft_state.keys[0].sharding.spec
        record(shape, "greedy SD, SeparateDraft", same, f"draft cache spec {draft_spec}", time.perf_counter() - start)

        start = time.perf_counter()
        placed = jax.device_put(scores, NamedSharding(mesh, PartitionSpec("data")))
        chosen = select_top_k(placed, jax.device_put(score_lengths, NamedSharding(mesh, PartitionSpec("data"))),
                              k=32, sinks=2, window=4)
        record(shape, "select_top_k", np.array_equal(np.asarray(chosen), reference["topk"]), "",
               time.perf_counter() - start)

        if shape == (1, 8):  # the Mosaic TPU kernels (TPU interpret mode) per device inside shard_map
            start = time.perf_counter()
            import functools

            from jaxspec.parallel.sharding import per_device_kernel
            from pallas_kernels.reference import (clean_indices, dense_history_reference, merge_partials,
                                                  normalize, sparse_history_reference)
            from pallas_kernels.tpu_attention import tpu_dense_history_partials, tpu_sparse_history_partials

            keys = jax.random.split(jax.random.PRNGKey(3), 3)
            kq = 0.3 * jax.random.normal(keys[0], (2, 8, 16, 8))
            kk, kv = (jax.random.normal(key, (2, 8, 256, 8)) for key in keys[1:])
            k_lengths = jnp.asarray([0, 200], jnp.int32)  # an all-masked row, a ragged one
            raw = np.random.RandomState(5).randint(-2, 210, (2, 32)).astype(np.int32)
            raw[1, :4] = 7  # duplicates
            k_idx = clean_indices(jnp.asarray(raw), k_lengths)
            place = NamedSharding(mesh, PartitionSpec(None, "tensor"))
            dense = functools.partial(tpu_dense_history_partials, interpret=True)
            sparse = functools.partial(tpu_sparse_history_partials, chunk=16, interpret=True)
            with use_mesh(mesh):
                both = jax.jit(lambda q_, k_, v_, len_, idx_: (per_device_kernel(dense, q_, k_, v_, len_),
                                                               per_device_kernel(sparse, q_, k_, v_, idx_)))
                got_dense, got_sparse = both(*(jax.device_put(x, place) for x in (kq, kk, kv)), k_lengths, k_idx)
            diff = max(max_diff(normalize(merge_partials(got_dense, axis=2)),
                                normalize(dense_history_reference(kq, kk, kv, k_lengths))),
                       max_diff(normalize(merge_partials(got_sparse, axis=2)),
                                normalize(sparse_history_reference(kq, kk, kv, k_idx))))
            record(shape, "TPU kernels (interpret) per device in shard_map (dense + sparse)", diff < 1e-5,
                   f"max |dout| {diff:.1e}", time.perf_counter() - start)

        if shape != (2, 4):
            continue
        start = time.perf_counter()
        dp = run_dp(shard_params(dp_params, dp_config, mesh), shard_cache(init_cache(dp_config, 8, 16), mesh))
        ref_dp = reference["dp"]
        ok = (np.array_equal(dp.masks, ref_dp.masks) and np.array_equal(dp.weights, ref_dp.weights)
              and np.allclose(dp.cosine, ref_dp.cosine, atol=1e-5) and np.allclose(dp.alpha, ref_dp.alpha))
        record(shape, "KnapSpec DP (candidates, cosine, alpha)", ok, f"{len(dp)} candidates, max |dcos| "
               f"{max_diff(dp.cosine, ref_dp.cosine):.1e}", time.perf_counter() - start)

        start = time.perf_counter()
        result = speculative_generate(sharded, target, prompts, draft_policy=self_policy, draft_state=self_state,
                                      engine=engine)
        record(shape, "greedy SD, SelfDraft", result.rows() == reference["ar"], "", time.perf_counter() - start)

        start = time.perf_counter()
        rows = generate(params, target, prompts, 10, mesh=mesh).rows()  # unplaced params, explicit mesh
        record(shape, "generate(mesh=...) places params", rows == reference["ar"], "", time.perf_counter() - start)

        start = time.perf_counter()
        lowered = forward_compiled.lower(sharded, step_tokens, second.cache, config=target)
        counts = collectives(lowered.compile().as_text())
        record(shape, "forward: no all-gather (cache never gathered)", counts["all-gather"] == 0, counts,
               time.perf_counter() - start)

        start = time.perf_counter()
        kernels = target.replace(attention_backend="pallas-interpret")
        with use_mesh(mesh):
            kernel_first, kernel_second = forward_pair(sharded, cache, config=kernels)
            counts = collectives(forward_compiled.lower(sharded, step_tokens, kernel_first.cache,
                                               config=kernels).compile().as_text())
        diff = max(max_diff(kernel_first.logits, ref_first.logits), max_diff(kernel_second.logits, ref_second.logits))
        record(shape, "pallas-interpret forward in shard_map (dense + sparse)", diff < 1e-4 and
               counts["all-gather"] == 0, f"max |dlogits| {diff:.1e}, {counts}", time.perf_counter() - start)

        errors = []
        try:
            shard_params(init_params(target.replace(num_heads=12, num_kv_heads=4), jax.random.PRNGKey(0)),
                         target.replace(num_heads=12, num_kv_heads=4), make_mesh(1, 8))
        except ValueError as err:
            errors.append(str(err))
        try:
            generate(sharded, target, prompts[:6], 4, mesh=make_mesh(8, 1))
        except ValueError as err:
            errors.append(str(err))
        ok = (len(errors) == 2 and "num_heads=12" in errors[0] and "'tensor' of size 8" in errors[0]
              and "batch=6" in errors[1] and "'data' of size 8" in errors[1])
        record(shape, "clear errors (heads / batch not divisible)", ok, " | ".join(errors))
    return {"results": results, "devices": jax.device_count(), "jax": jax.__version__}


# ---------------------------------------------------------------------------- the TPU-interpret worker
#: host devices of the TPU-interpret worker: 8 for the mesh plus CPU device 0, which stays out of it
TPU_WORKER_DEVICES = 9


def _tpu_worker() -> dict:  # runs in its own subprocess, with TPU_WORKER_DEVICES host devices
    """Greedy speculative decoding and Dustin with the target on ``pallas-tpu-interpret`` under an
    8-device tensor-parallel mesh (tensor = 8) emit the same tokens as on ``xla`` under that mesh.

    The mesh is devices 1..8, not 0..7: JAX's ``io_callback`` (which the TPU interpreter calls for
    every buffer, DMA and semaphore) stages its arguments on CPU device 0, and a host-to-device copy
    over 100 KiB onto a device that is running its shard of the same program never completes
    (docs/tpu.md, "Tests")."""
    import jax
    import numpy as np

    from jaxspec.config import ModelConfig
    from jaxspec.decoding.autoregressive import generate
    from jaxspec.decoding.policies import SeparateDraft
    from jaxspec.decoding.speculative import EngineConfig, speculative_generate
    from jaxspec.dustin import DustinConfig, dustin_policies
    from jaxspec.models.llama import init_params
    from jaxspec.models.sharding import shard_params
    from jaxspec.parallel import make_mesh

    assert jax.device_count() == TPU_WORKER_DEVICES, jax.devices()
    mesh = make_mesh(1, 8, devices=jax.devices()[1:])
    # 16 query / 8 KV heads (one KV head per device), untied head; the draft stays on xla
    target = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=16,
                         num_kv_heads=8, head_dim=8, dtype="float32", attention_backend="xla", name="tiny-tpu-tp8")
    draft = target.replace(num_layers=1, tie_word_embeddings=True, name="tiny-tpu-tp8-draft")
    params = shard_params(init_params(target, jax.random.PRNGKey(0), scale=0.3), target, mesh)
    draft_params = shard_params(init_params(draft, jax.random.PRNGKey(1), scale=0.3), draft, mesh)
    prompts = [np.random.RandomState(7).randint(0, 128, n).tolist() for n in (140, 30)]  # 140 > budget 128
    engine = EngineConfig(gamma=2, max_new_tokens=3)  # the first round verifies 3 rows through the kernels
    dustin = DustinConfig(budget=128, m=30, target_layer=1, target_heads=(0, 1, 2, 3), draft_layers=(0,),
                          draft_heads=((0, 1, 2, 3),), mode="hybrid")
    results, rows = [], {}
    for name in ("xla", "pallas-tpu-interpret"):
        config = target.replace(attention_backend=name)
        start = time.perf_counter()
        classic = speculative_generate(params, config, prompts, draft_policy=SeparateDraft(draft),
                                       draft_params=draft_params, engine=engine)
        middle = time.perf_counter()
        draft_policy, verify = dustin_policies(dustin, config, draft)
        sparse = speculative_generate(params, config, prompts, draft_policy=draft_policy, draft_params=draft_params,
                                      verify_policy=verify, engine=engine)
        rows[name] = (classic.rows(), sparse.rows(), classic.metrics["accepted_histogram"])
        results.append({"mesh": [1, 8], "case": f"{name}: greedy SD + Dustin", "ok": True,
                        "detail": f"SD {middle - start:.1f} s, Dustin {time.perf_counter() - middle:.1f} s",
                        "seconds": round(time.perf_counter() - start, 2)})
    single = generate(init_params(target, jax.random.PRNGKey(0), scale=0.3), target, prompts, 3).rows()
    same = rows["pallas-tpu-interpret"] == rows["xla"]
    results.append({"mesh": [1, 8], "case": "pallas-tpu-interpret == xla (greedy SD, Dustin) in shard_map",
                    "ok": same and rows["xla"][0] == single and [len(r) for r in rows["xla"][1]] == [3, 3],
                    "detail": f"{rows['pallas-tpu-interpret'][:2]} vs {rows['xla'][:2]}", "seconds": 0.0})
    return {"results": results, "devices": jax.device_count(), "jax": jax.__version__}


def _print_summary(summary: dict) -> None:
    print(f"{'mesh (data, tensor)':<20} {'check':<55} {'ok':<5} {'s':>6}  detail")
    for row in summary["results"]:
        mesh = f"({row['mesh'][0]}, {row['mesh'][1]})"
        print(f"{mesh:<20} {row['case']:<55} {str(row['ok']):<5} {row['seconds']:>6.2f}  {row['detail'][:110]}")


# ---------------------------------------------------------------------------- pytest side
@dataclasses.dataclass
class _Worker:
    flag: str
    devices: int
    proc: subprocess.Popen
    began: float
    files: tuple  # stdout, stderr

    def read(self) -> tuple:
        texts = []
        for f in self.files:
            f.seek(0)
            texts.append(f.read())
        return tuple(texts)

    def close(self) -> None:  # a test that failed before reading its worker leaves no process behind
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in self.files:
            f.close()


def _start_worker(flag: str, devices: int) -> _Worker:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # output to files, not pipes: a worker never waits on a full pipe while the other one is read
    files = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), flag], cwd=REPO, env=env,
                            stdout=files[0], stderr=files[1], text=True)
    return _Worker(flag, devices, proc, time.perf_counter(), files)


def _finish_worker(worker: _Worker, timeout: int) -> dict:
    """The worker's summary once it exits (``timeout``: seconds from its start; then it is killed)."""
    try:
        worker.proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - worker.began)))
    except subprocess.TimeoutExpired:
        worker.proc.kill()
        worker.proc.wait()
    elapsed = time.perf_counter() - worker.began
    stdout, stderr = worker.read()
    print(stdout)
    if worker.proc.returncode != 0:
        pytest.fail(f"{worker.devices}-device worker {worker.flag} failed (exit {worker.proc.returncode}) after "
                    f"{elapsed:.0f} s (limit {timeout} s):\n{stdout[-4000:]}\n{stderr[-6000:]}")
    line = [ln for ln in stdout.splitlines() if ln.startswith("SUMMARY ")][-1]
    summary = json.loads(line[len("SUMMARY "):])
    summary["elapsed_s"] = elapsed
    return summary


@pytest.fixture(scope="module")
def workers(request):
    """The two worker subprocesses, started together: neither keeps two cores busy for long (XLA
    compiles, the TPU interpreter's callbacks), so on a machine of two or more cores they overlap.
    Only the workers of the tests selected in this session start."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    wanted = {"--worker": ("test_sharded_results_equal_single_device", 8),
              "--tpu-worker": ("test_tpu_interpret_backend_in_shard_map_equals_xla", TPU_WORKER_DEVICES)}
    started = {flag: _start_worker(flag, devices) for flag, (test, devices) in wanted.items() if test in selected}
    yield started
    for worker in started.values():
        worker.close()


def test_sharded_results_equal_single_device(workers):
    sharded_summary = _finish_worker(workers["--worker"], timeout=600)
    rows = sharded_summary["results"]
    assert sharded_summary["devices"] == 8
    cases = {(tuple(r["mesh"]), r["case"]) for r in rows}
    for mesh in MESHES:  # every core case ran on every mesh
        for case in ("forward (prefill + sparse verify)", "greedy AR generate", "greedy SD, SeparateDraft",
                     "select_top_k"):
            assert (mesh, case) in cases
    failed = [f"{r['mesh']} {r['case']}: {r['detail']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)



def test_tpu_interpret_backend_in_shard_map_equals_xla(workers):
    """Greedy speculative decoding and Dustin with the target on ``pallas-tpu-interpret`` under a
    tensor = 8 host mesh emit the same tokens as on ``xla`` (the Mosaic kernels per device inside
    ``shard_map``, in TPU interpret mode); a subprocess of its own (9 host devices, see _tpu_worker)."""
    summary = _finish_worker(workers["--tpu-worker"], timeout=600)
    assert summary["devices"] == TPU_WORKER_DEVICES and len(summary["results"]) == 3
    failed = [f"{r['case']}: {r['detail']}" for r in summary["results"] if not r["ok"]]
    assert not failed, "\n".join(failed)

# ---------------------------------------------------------------------------- in-process (1 device)
def test_rules_table_and_logical_axes():
    from jaxspec.config import ModelConfig
    from jaxspec.models.sharding import param_logical_axes
    from jaxspec.parallel import RULES, ShardingRules
    from jax.sharding import PartitionSpec as P

    assert RULES.spec(("batch", "kv_heads", "sequence", "head_dim")) == P("data", "tensor", None, None)
    assert RULES.spec(("embed", "mlp")) == P(None, "tensor")
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=4, attention_bias=True)
    axes = param_logical_axes(config)
    assert axes.layers[0].wo == ("q_heads", "embed") and axes.layers[0].bk == ("kv_heads",)
    assert axes.lm_head == ("embed", "vocab") and axes.embed == ("vocab_in", "embed")
    assert param_logical_axes(config.replace(attention_bias=False, tie_word_embeddings=True)).lm_head is None
    with pytest.raises(ValueError, match="valid mesh axes"):
        ShardingRules(mlp="model")
    with pytest.raises(ValueError, match="unknown logical axis 'heads'"):
        RULES.spec(("heads",))


def test_parse_mesh_and_divisibility_errors():
    from jaxspec.config import preset
    from jaxspec.models.sharding import check_divisible
    from jaxspec.parallel import make_mesh, parse_mesh_shape

    assert parse_mesh_shape("data=2,tensor=4") == {"data": 2, "tensor": 4}
    assert parse_mesh_shape("tensor=8") == {"data": 1, "tensor": 8}
    for bad, message in (("data=2,tensr=4", "bad mesh item 'tensr=4'"), ("data=0", "must be >= 1"),
                         ("data=2,data=2", "given twice"), ("", "empty mesh spec")):
        with pytest.raises(ValueError, match=message):
            parse_mesh_shape(bad)
    with pytest.raises(ValueError, match=r"data=2 x tensor=4 = 8 devices, but 1 device"):
        make_mesh(2, 4)
    with pytest.raises(ValueError, match=r"num_heads=28 of 'qwen2.5-7b-shape' is not divisible by the mesh axis "
                                         r"'tensor' of size 8"):
        check_divisible(preset("qwen2.5-7b-shape"), {"data": 1, "tensor": 8})
    with pytest.raises(ValueError, match=r"num_kv_heads=4 .* 'tensor' of size 7"):
        check_divisible(preset("qwen2.5-7b-shape"), {"data": 1, "tensor": 7})  # 28 q heads split, 4 KV heads do not
    with pytest.raises(ValueError, match=r"num_heads=14 .* 'tensor' of size 4"):
        check_divisible(preset("qwen2.5-0.5b-shape"), {"data": 1, "tensor": 4})


def test_cli_refuses_mesh_where_unsupported(capsys):
    from experiments.run import main

    assert main(["bench-decode", "--mesh", "data=2"]) == 2
    assert "--mesh is not supported by 'bench-decode'" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--mesh", "data=2,tensr=4"]) == 2
    assert "bad mesh item" in capsys.readouterr().err


def test_memory_plan_qwen72b_32k_batch16_on_4_devices():
    from jaxspec.config import preset
    from jaxspec.models.memory import MemoryPlanError, plan_memory

    config = preset("qwen2.5-72b-shape")  # 80 layers, d 8192, F 29568, 64 q / 8 KV heads of 128, V 152064, bf16
    plan = plan_memory(config, context=32768, batch=16, mesh="tensor=4")
    # by hand, per layer (bf16): wq, wo 8192*8192; wk, wv 8192*1024; 3 MLP 8192*29568; biases 8192 + 2*1024:
    # 877,668,352 elements * 2 B = 1,755,336,704 B, all split over 4 devices; + 2 float32 norms (65,536 B) whole
    per_layer = 1_755_336_704 // 4 + 65_536
    embed = 152064 * 8192 * 2  # replicated
    lm_head = 152064 * 8192 * 2 // 4  # vocab-sharded
    assert plan.weights == 80 * per_layer + embed + lm_head + 8192 * 4 == 38_226_280_448
    # KV: 2 (K, V) * 80 layers * 16 rows * 8/4 KV heads * 32768 slots * 128 * 2 B, + lengths 16 * 4 B
    assert plan.target_cache == 2 * 80 * 16 * 2 * 32768 * 128 * 2 + 64 == 42_949_673_024
    assert plan.total == 81_175_953_472
    plan.check(141 * 10**9)  # fits an H200
    with pytest.raises(MemoryPlanError, match=r"needs 75.60 GiB .* > device memory 74.51 GiB"):
        plan.check(80 * 10**9)  # not an 80 GB card
    with pytest.raises(MemoryPlanError, match="reserve 70.00 GiB"):
        plan.check(141 * 10**9, reserve_bytes=70 * 2**30)
    # data parallelism splits the cache rows but not the weights
    both = plan_memory(config, context=32768, batch=16, mesh={"data": 2, "tensor": 4})
    assert both.weights == plan.weights and both.target_cache == (plan.target_cache - 64) // 2 + 64


def test_memory_plan_with_draft_and_budget():
    from jaxspec.config import preset
    from jaxspec.models.memory import plan_memory
    from jaxspec.parallel import ShardingRules

    target, draft = preset("qwen2.5-7b-shape"), preset("qwen2.5-0.5b-shape")
    plan = plan_memory(target, context=8192, batch=8, mesh=(2, 2), draft_config=draft, draft_budget=1024)
    # draft KV: 2 * 24 layers * 8/2 rows * 2/2 KV heads * 1024 slots * 64 * 2 B + 8 * 4 B lengths
    assert plan.draft_cache == 2 * 24 * 4 * 1 * 1024 * 64 * 2 + 32
    assert plan.target_cache == 2 * 28 * 4 * 2 * 8192 * 128 * 2 + 32
    # draft, tied head (no lm_head): embedding whole, every layer matrix split over tensor=2
    per_layer = (896 * 896 * 2 + 896 * 128 * 2 + 3 * 896 * 4864 + 896 + 2 * 128) * 2 // 2 + 2 * 896 * 4
    assert plan.draft_weights == 24 * per_layer + 151936 * 896 * 2 + 896 * 4
    assert plan.total == plan.weights + plan.target_cache + plan.draft_weights + plan.draft_cache
    # a draft whose heads do not split over tensor=4 needs replicated-head rules
    with pytest.raises(ValueError, match="num_heads=14"):
        plan_memory(target, context=8192, batch=8, mesh=(1, 4), draft_config=draft)
    replicated = ShardingRules(q_heads=None, kv_heads=None, mlp=None, vocab=None)
    plan = plan_memory(target, context=8192, batch=8, mesh=(1, 4), draft_config=draft, draft_rules=replicated)
    assert plan.draft_cache == 2 * 24 * 8 * 2 * 8192 * 64 * 2 + 32


if __name__ == "__main__" and ("--worker" in sys.argv or "--tpu-worker" in sys.argv):
    began = time.perf_counter()
    summary = _tpu_worker() if "--tpu-worker" in sys.argv else _worker()
    _print_summary(summary)
    print(f"worker total {time.perf_counter() - began:.1f} s")
    print("SUMMARY " + json.dumps(summary), flush=True)
