"""The coupled (whole-layer) knapsack DP: KnapSpec's DP with whole layers as items.

* :func:`coupled_knapsack_dp` -- the KnapSpec DP of :mod:`jaxspec.knapspec.dp` with whole layers
  as items: one transition per layer, ``execute: g <- MLP(Attn(g))`` or ``skip: g`` (slot
  ``j + 1``), value = sum over reference tokens of ``cos(g, x)`` with ``x`` the target's state
  after that layer; the same ``lax.scan`` over layers vectorised over all slots, the same
  branch-parallel attention (every branch attends to the true full-model prefix KV), the same
  pruning (mean cosine ``< tau``), the same fixed edge layers (0 and L-1 never skipped) and the
  same greedy-agreement alpha (``dp.transition``, ``dp.model_sublayers``, ``dp.agreement_alpha``).
  Slot ``j`` = ``j`` skipped layers. CLaSp (:mod:`jaxspec.baselines.clasp`) plans with it.
* :func:`plan_coupled_skip_set` -- the KnapSpec ablation "coupled instead of decoupled"
  (docs/methods.md §4.4): the coupled DP with budget ``floor(L / 2)`` layers (half the layers,
  like the decoupled budget is half the total weight), KnapSpec's pruning, then the usual
  (candidate, gamma) grid search under TPT or TPL. Used by ``KnapSpecPlanner`` when
  ``KnapSpecConfig.coupled``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.knapspec import dp
from jaxspec.knapspec.latency import LatencyModel
from jaxspec.knapspec.planner import Plan, choose_plan
from jaxspec.models.cache import KVCache


# ---------------------------------------------------------------------------- coupled DP
def _coupled_dp_fn(params, stacked, cache: KVCache, prefix_len, states, token_mask, *, config, budget, tau,
                   branch_chunk, alpha_chunk):
    num_layers = config.num_layers
    _, _, attn_all, mlp_all = dp.model_sublayers(config, prefix_len, states.shape[2], branch_chunk)
    layer_xs = (stacked, jnp.stack(cache.keys[1:]), jnp.stack(cache.values[1:]))
    targets = states[4::2]  # the state after each layer 1 .. L-1 (boundary 2l + 2)
    can_skip = jnp.arange(1, num_layers) < num_layers - 1
    num_slots = budget + 1
    g0 = states[2]
    g = jnp.broadcast_to(g0[None], (num_slots,) + g0.shape)
    valid = jnp.arange(num_slots) == 0
    denom = jnp.maximum(jnp.sum(token_mask), 1.0)

    def body(carry, xs):
        g, valid = carry
        layer_x, target, skip_ok = xs
        executed = mlp_all(layer_x, attn_all(layer_x, g))
        g, valid, value, skipped = dp.transition(g, valid, executed, target, token_mask, denom, w=1,
                                                  skip_allowed=skip_ok, budget=budget, tau=tau)
        return (g, valid), (value, skipped, valid)

    (g, _), (values, skipped, valids) = jax.lax.scan(body, (g, valid), (layer_xs, targets, can_skip))
    alpha = dp.agreement_alpha(params, config, g, states[-1], token_mask, alpha_chunk)
    return values, skipped, valids, alpha, g


_coupled_dp = jax.jit(_coupled_dp_fn, static_argnames=("config", "budget", "tau", "branch_chunk", "alpha_chunk"))


def backtrack_coupled(skipped: np.ndarray, valid: np.ndarray, num_layers: int) -> Tuple[np.ndarray, np.ndarray]:
    """``skipped``/``valid`` ``[n, J]`` (scanned layers 1 .. L-1) -> masks ``[C, L, 2]`` of the
    surviving final slots (a skipped layer has both columns set) and those slots."""
    slots = np.nonzero(valid[-1])[0]
    masks = np.zeros((len(slots), num_layers, 2), bool)
    for c, slot in enumerate(slots):
        j = int(slot)
        for k in range(skipped.shape[0] - 1, -1, -1):
            if not valid[k, j]:
                raise AssertionError(f"backtrack reached an empty slot (layer {k + 1}, j={j})")
            if skipped[k, j]:
                masks[c, k + 1, :] = True
                j -= 1
        if j != 0:
            raise AssertionError(f"backtrack of slot {slot} ended at {j} skipped layers, not 0")
    return masks, slots


def coupled_knapsack_dp(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *,
                        budget: Optional[int] = None, tau: float = dp.DEFAULT_TAU, branch_chunk: Optional[int] = None,
                        alpha_chunk: Optional[int] = None, keep_states: bool = False) -> dp.Candidates:
    """Whole-layer DP (arguments as :func:`jaxspec.knapspec.dp.knapsack_dp`); ``budget`` in layers
    (default ``floor(L / 2)``). Candidate ``c`` skips ``weights[c]`` whole layers."""
    config = dp.dp_config(config)
    num_layers = config.num_layers
    budget = num_layers // 2 if budget is None else int(budget)
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    if num_layers < 2 or budget < 1:
        return dp.trivial_candidates(params, config, states, token_mask, 1, 1, max(budget, 0))
    outer = params.replace(layers=())  # the scan gets the layers stacked
    values, skipped, valid, alpha, final = _coupled_dp(
        outer, dp.stacked_scan_layers(params), cache, jnp.asarray(prefix_len, jnp.int32), states, token_mask, config=config, budget=budget,
        tau=float(tau), branch_chunk=branch_chunk, alpha_chunk=alpha_chunk)
    values, skipped, valid = (np.asarray(x) for x in (values, skipped, valid))
    masks, slots = backtrack_coupled(skipped, valid, num_layers)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    return dp.Candidates(masks=masks, weights=slots, cosine=np.asarray(values[-1], np.float64)[slots] / denom,
                         alpha=np.asarray(alpha, np.float64)[slots], w_attn=1, w_mlp=1, budget=budget,
                         final_states=np.asarray(final)[slots] if keep_states else None)


def coupled_knapsack_reference(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *,
                               budget: Optional[int] = None, tau: float = dp.DEFAULT_TAU):
    """The same recursion as a Python loop over layers and slots, one candidate state at a time
    (reference for tests): ``{slot: (value, mask [L, 2])}`` of the surviving final slots."""
    config = dp.dp_config(config)
    num_layers = config.num_layers
    budget = num_layers // 2 if budget is None else int(budget)
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    apply_single, layers, _, can_skip = dp.model_problem(params, config, cache, prefix_len, states)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    slots = {0: (states[2], -np.inf, np.zeros((num_layers, 2), bool))}
    for k, layer_x in enumerate(layers):
        target = states[2 * (k + 1) + 2]
        new = {}
        for j, (g, _, mask) in sorted(slots.items()):  # execute first
            h = apply_single(1, layer_x, apply_single(0, layer_x, g))
            value = float(dp.cos_sum(h, target, token_mask))
            if value / denom >= tau and value > new.get(j, (None, -np.inf))[1]:
                new[j] = (h, value, mask)
        if np.all(can_skip[k]):  # a whole layer: both of its sub-layers skippable
            for j, (g, _, mask) in sorted(slots.items()):
                if j + 1 > budget:
                    continue
                value = float(dp.cos_sum(g, target, token_mask))
                if value / denom >= tau and value > new.get(j + 1, (None, -np.inf))[1]:
                    skipped = mask.copy()
                    skipped[k + 1, :] = True
                    new[j + 1] = (g, value, skipped)
        slots = new
    return {j: (value / denom, mask) for j, (_, value, mask) in slots.items()}


# ---------------------------------------------------------------------------- planning
def reference_states(target_params, config, cache, tokens, prefix_len):
    """The target's boundary states of the reference tokens (:func:`~jaxspec.knapspec.dp.boundary_states`)."""
    return dp.boundary_states(target_params, config, tokens, cache, prefix_len)


def plan_coupled_skip_set(target_params, config: ModelConfig, cache, tokens, token_mask, prefix_len,
                          latency: LatencyModel, n: float, knapspec,
                          states=None) -> Tuple[Plan, dp.Candidates, Tuple[int, int]]:
    """KnapSpec with whole-layer items (the coupled ablation): coupled DP (budget L // 2, KnapSpec's
    tau), then the (candidate, gamma) grid search of ``knapspec`` (objective, gammas). ``states``: the
    window's boundary states when already known (as :func:`~jaxspec.knapspec.skip_planner.plan_skip_set`)."""
    if states is None:
        states = reference_states(target_params, config, cache, tokens, prefix_len)
    candidates = coupled_knapsack_dp(target_params, config, cache, prefix_len, states, token_mask,
                                     tau=knapspec.tau, branch_chunk=knapspec.branch_chunk)
    plan = choose_plan(candidates.masks, candidates.alpha, latency, n, gammas=knapspec.plan_gammas,
                       objective=knapspec.objective, exclude_full=knapspec.exclude_full)
    return plan, candidates, (1, 1)


__all__ = ["backtrack_coupled", "coupled_knapsack_dp", "coupled_knapsack_reference", "plan_coupled_skip_set",
           "reference_states"]
