"""What a ``knapspec`` case measures beside its decode, and the DP's shape.

* the paired autoregressive run (:func:`ar_run`);
* one draft forward (dynamic and static skip mask, or a budget plan) and one verification forward, timed as one
  jitted call and in a jitted loop (:func:`forward_times`, :func:`budget_draft_times`);
* the Pearson correlation (:func:`pearson`) and the plain stretches' fixed / per-step split (:func:`stretch_fit`);
* the rows and reference tokens one DP runs on and its memory bound (:func:`dp_shape`, :func:`auto_branch_chunk`).

Used by ``case`` (:class:`~experiments.knapspec.case.Case`); ``experiment`` and ``bench_plan`` use :func:`pearson`.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments.knapspec.model import Model


def pearson(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def stretch_fit(stretches, ar_step_s: Optional[float] = None) -> Optional[Dict[str, float]]:
    """Least squares of each plain stretch's wall seconds over its steps, ``seconds = fixed + steps x step``: the
    per-stretch fixed cost (dispatch, the stretch's host read) apart from the per-step cost, which is what the
    paired AR run's step compares with. None with fewer than two distinct stretch lengths."""
    if len({steps for steps, _ in stretches}) < 2:
        return None
    x = np.array([steps for steps, _ in stretches], np.float64)
    y = np.array([seconds for _, seconds in stretches], np.float64)
    step, fixed = np.polyfit(x, y, 1)
    return {"fixed_s": float(fixed), "step_s": float(step),
            "step_over_ar_step": float(step / ar_step_s) if ar_step_s else None}


def _copy(tree):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.copy, tree)


def ar_run(model: Model, prefilled, max_new_tokens: int) -> Dict[str, Any]:
    """Greedy autoregressive decoding from a copy of the prefilled cache (compiled beforehand)."""
    import jax

    from jaxspec.decoding.autoregressive import decode_loop
    from jaxspec.decoding.sampling import SamplingConfig

    cache, logits = _copy(prefilled)
    jax.block_until_ready(cache)
    start = time.perf_counter()
    out, _ = decode_loop(model.params, cache, logits, jax.random.PRNGKey(0), config=model.config,
                          sampling=SamplingConfig(), max_new_tokens=max_new_tokens, stop_tokens=())
    out = np.asarray(out)
    decode_s = time.perf_counter() - start
    return {"tokens": out, "decode_s": decode_s, "tokens_per_s": out.size / decode_s,
            "step_s": decode_s / max_new_tokens}


_FORWARDS: Dict[Any, Any] = {}


def forward_times(model: Model, prefilled, mask, verify_rows: int, repeats: int = 5,
                  steps_per_call: int = 4, long_steps_per_call: int = 0) -> Dict[str, float]:
    """Median seconds of one draft forward (1 token) with the dynamic skip ``mask`` (a ``lax.cond``
    per sub-layer) and with the same mask static (skipped sub-layers removed at trace time, one
    compile per mask), and of one verification forward (``verify_rows`` tokens, full model) on the
    prefilled cache, each one jitted call.

    ``draft_step_in_loop_s`` / ``draft_step_static_in_loop_s``: the same two draft forwards timed as
    the latency profile times its forwards and as the draft loop runs them, ``steps_per_call`` of them
    in one jitted loop carrying the (donated) cache, per forward (median of ``repeats`` calls, the two
    variants round-robin); on a copy of the cache. A call per forward returning only the logits lets
    XLA drop the forward's cache writes and pays its own dispatch; the profile and the draft loop
    write the cache inside one compiled loop. ``long_steps_per_call`` (the profile's, 0: none): each loop
    is timed at that call length too and its step is the slope between the two, without the call's
    fixed cost, as the profile's steps are."""
    import jax
    import jax.numpy as jnp

    from jaxspec.knapspec.latency import forward_loop, forward_loop_fn
    from jaxspec.models.llama import forward, freeze_skip_mask

    config = model.config
    cache = prefilled[0]
    batch = cache.batch_size
    if config not in _FORWARDS:
        _FORWARDS[config] = (jax.jit(lambda p, t, c, m: forward(p, t, c, config=config, skip_mask=m).logits),
                             jax.jit(lambda p, t, c: forward(p, t, c, config=config).logits))
    draft, verify = _FORWARDS[config]
    one = jnp.zeros((batch, 1), jnp.int32)
    rows = jnp.zeros((batch, max(int(verify_rows), 1)), jnp.int32)
    mask = jnp.asarray(mask, bool)

    def median(fn, *a):
        return _median_call_s(lambda: fn(*a), repeats)

    frozen = freeze_skip_mask(mask)
    key = (config, frozen)
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(lambda p, t, c: forward(p, t, c, config=config, skip_mask=frozen).logits)
    out = {"draft_forward_s": median(draft, model.params, one, cache, mask),
           "draft_forward_static_s": median(_FORWARDS[key], model.params, one, cache),
           "verify_forward_s": median(verify, model.params, rows, cache)}
    if "static_loop" not in _FORWARDS:
        _FORWARDS["static_loop"] = jax.jit(forward_loop_fn, static_argnames=("config", "steps", "mask"),
                                           donate_argnames=("cache",))
    static_loop, steps = _FORWARDS["static_loop"], int(steps_per_call)
    calls = {"draft_step_in_loop_s": lambda c, k: forward_loop(model.params, c, one, mask, config=config, steps=k),
             "draft_step_static_in_loop_s": lambda c, k: static_loop(model.params, c, one, mask=frozen,
                                                                     config=config, steps=k)}
    out.update(_in_loop_step_s(calls, cache, repeats, steps, long_steps_per_call))
    out.update(draft_steps_per_call=steps, draft_long_steps_per_call=int(long_steps_per_call))
    return out


def timed_as(fwd: Dict[str, Any]) -> str:
    """How the draft-step check timed its forwards: one call length, or the slope between two."""
    long_steps = int(fwd.get("draft_long_steps_per_call", 0))
    if long_steps:
        return f"{fwd['draft_steps_per_call']} and {long_steps} forwards per jitted call, the slope between them"
    return f"{fwd['draft_steps_per_call']} forwards per jitted call"


def _median_call_s(call, repeats: int) -> float:
    """Median seconds of ``call()`` (a jitted call) over ``repeats`` timed calls after one untimed."""
    import jax

    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _in_loop_step_s(calls: Dict[str, Any], cache, repeats: int, steps: int, long_steps: int = 0) -> Dict[str, float]:
    """Per-forward median seconds of each ``calls[name](cache, k) -> (tokens, cache)`` (``k`` forwards in
    one jitted loop donating the cache), round-robin over the names on one copy of ``cache``; the first
    round compiles and is not timed. With ``long_steps`` each is timed at ``steps`` and ``long_steps`` a
    call and its forward is the slope between the two (the call's fixed cost off,
    :func:`~jaxspec.knapspec.latency.call_overhead`); ``<name>_call_overhead_s`` is that cost."""
    import jax

    from jaxspec.knapspec.latency import call_overhead

    lengths = (steps, long_steps) if long_steps else (steps,)
    state = {"cache": _copy(cache)}
    times: Dict[tuple, List[float]] = {(name, k): [] for name in calls for k in lengths}
    for round_ in range(1 + repeats):
        for name, call in calls.items():
            for k in lengths:
                start = time.perf_counter()
                tokens, state["cache"] = call(state["cache"], k)
                jax.block_until_ready(tokens)
                if round_:
                    times[(name, k)].append((time.perf_counter() - start) / k)
    del state
    out = {}
    for name in calls:
        step = float(np.median(times[(name, steps)]))
        if long_steps:
            fixed = call_overhead(step, float(np.median(times[(name, long_steps)])), steps, long_steps)
            out[f"{name}_call_overhead_s"] = fixed
            step -= fixed / steps
        out[name] = step
    return out


def _budget_loop_fn(params, cache, tokens, *, config, plan, sinks, window, steps):
    """``steps`` draft forwards under a budget ``plan`` at the cache's current lengths, each fed the
    previous step's greedy tokens (as :func:`~jaxspec.knapspec.latency.forward_loop_fn`)."""
    import jax
    import jax.numpy as jnp

    from jaxspec.knapspec.budgeted import budgeted_forward

    start = cache.lengths

    def body(_, carry):
        cache, tokens = carry
        logits, cache, _ = budgeted_forward(params, tokens, cache.with_lengths(start), config=config, plan=plan,
                                            sinks=sinks, window=window)
        return cache.with_lengths(start), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    cache, tokens = jax.lax.fori_loop(0, steps, body, (cache, tokens))
    return tokens, cache


def budget_draft_times(model: Model, prefilled, plan, sinks: int, window: int, repeats: int = 5,
                       steps_per_call: int = 4, long_steps_per_call: int = 0) -> Dict[str, float]:
    """One draft forward under a budget ``plan`` (docs/methods.md §5.4: dense, budgeted or skipped
    Attention per layer), timed as :func:`forward_times` times the static skip mask: one jitted call,
    and ``steps_per_call`` forwards in one jitted loop carrying the (donated) cache, per forward
    (median of ``repeats``; on a copy of the cache); with ``long_steps_per_call`` the slope between the two
    call lengths, as :func:`forward_times`."""
    import jax
    import jax.numpy as jnp

    from jaxspec.knapspec.budgeted import budgeted_forward_jit, freeze_plan

    config, cache = model.config, prefilled[0]
    frozen = freeze_plan(plan)
    one = jnp.zeros((cache.batch_size, 1), jnp.int32)
    single = _median_call_s(lambda: budgeted_forward_jit(model.params, one, cache, config=config, plan=frozen,
                                                         sinks=sinks, window=window)[0], repeats)
    if "budget_loop" not in _FORWARDS:
        _FORWARDS["budget_loop"] = jax.jit(_budget_loop_fn, static_argnames=("config", "plan", "sinks", "window",
                                                                            "steps"), donate_argnames=("cache",))
    loop, steps = _FORWARDS["budget_loop"], int(steps_per_call)
    looped = _in_loop_step_s({"draft_step_budget_in_loop_s": lambda c, k: loop(
        model.params, c, one, config=config, plan=frozen, sinks=sinks, window=window, steps=k)},
        cache, repeats, steps, long_steps_per_call)
    return {"draft_forward_budget_s": single, **looped, "draft_steps_per_call": steps,
            "draft_long_steps_per_call": int(long_steps_per_call)}


def auto_branch_chunk(config, batch: int, capacity: int, reference: int, budget_slots: int,
                      limit_bytes: float = 4e9) -> Optional[int]:
    """Branches per attention batch so the DP's float32 scores stay under ``limit_bytes``: ``batch`` and
    ``reference`` are the rows and tokens the DP runs on (:func:`dp_shape`)."""
    per_branch = 3 * 4 * batch * config.num_heads * reference * capacity
    if per_branch * budget_slots <= limit_bytes:
        return None
    return max(1, int(limit_bytes // per_branch))


def dp_shape(args, batch: int) -> Tuple[int, int]:
    """The rows and reference tokens per row one DP runs on: ``--plan-rows`` of the batch (else all), and
    ``--search-tokens`` with a two-stage plan, else the window, ``--max-reference-tokens`` or 64."""
    rows = min(int(args.plan_rows), batch) if args.plan_rows else batch
    return rows, int(args.search_tokens or args.max_reference_tokens or 64)


#: kernel rows per call the DP attention check times beside the kernel's default (64)
DP_CHECK_ROW_BLOCKS = (128, 256)
