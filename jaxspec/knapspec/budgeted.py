"""KnapSpec with budgeted attention as a third choice (docs/methods.md §5.4).

The paper's DP (docs/methods.md §4.3, :mod:`jaxspec.knapspec.dp`) chooses, per sub-layer,
*execute* or *skip*. Here every Attention sub-layer has a third choice: execute over a budget of
``K = sinks + window`` history slots (the first ``sinks`` cache slots and the last ``window``
ones, StreamingLLM's index set; the new tokens are always attended, causally). Its latency is the
latency model's ``t_attn(K)`` instead of ``t_attn(n)``, so it costs less at long context while
keeping most of the layer's effect. A multiple-choice knapsack:

* integer weights (:func:`choice_weights`): the dense Attention ``w_attn`` and the MLP ``w_mlp``
  as in the two-choice DP (heavier over lighter, rounded, capped; the lighter weighs 1) and the
  budgeted Attention ``w_budget = round(t_attn(K) / lighter)`` clipped to ``0 .. w_attn``: a
  budgeted Attention *saves* ``w_attn - w_budget``, a skipped one ``w_attn``, a skipped MLP
  ``w_mlp``; slots ``j = 0 .. floor((w_attn + w_mlp) L / 2)`` hold the exact saved weight;
* transitions of Attention sub-layer ``i`` (``g[i][j]`` the best state at depth ``i`` with saved
  weight ``j``, value the sum of cosines with the target's reference state, as in §4.3)::

      dense:    f_i(g[i-1][j])        -> slot j
      budgeted: f_i^K(g[i-1][j])      -> slot j + w_attn - w_budget
      skip:     g[i-1][j]             -> slot j + w_attn          (not layers 0 and L-1)

  MLP sub-layers keep execute / skip. A candidate whose mean cosine is ``< tau`` is pruned; each
  slot keeps the best candidate (dense first, then budgeted, then skip: a later choice replaces
  an earlier one only if strictly better). Layers 0 and L-1 are never skipped, but layer L-1's
  Attention may run budgeted; layer 0 stays dense (the DP starts after it, as in §4.3).

Plans are ``[L, 2]`` int8 codes (:data:`DENSE` 0, :data:`BUDGET` 1 -- Attention column only --,
:data:`SKIP` 2). :func:`dp_scan_choices` is one ``jax.lax.scan`` over layers vectorised over all
slots (the three Attention candidates of every slot are computed as batches), exactly like
:func:`jaxspec.knapspec.knapsack.dp_scan`; :func:`brute_force_choices` enumerates every plan (``6^(L-2)``
times the edge layers' choices) with the same pruning and budget: the oracle on small instances.
:func:`budgeted_forward` runs a plan (static: executed sub-layers only, the budgeted ones through
the sparse-history attention of ``verify_indices``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.knapspec.dp import (DEFAULT_TAU, WEIGHT_CAP, boundary_states, cos_sum, dp_config, knapsack_weights,
                                 per_sublayer_can_skip, skip_budget, stacked_scan_layers,
                                 sublayer_can_skip)
from jaxspec.knapspec.knapsack import FinalSlots
from jaxspec.knapspec.latency import LatencyModel
from jaxspec.knapspec.planner import tpt
from jaxspec.models.cache import KVCache
from jaxspec.models.layers import (attention_sublayer, decoder_layer, default_positions, embed, lm_head, mlp_sublayer,
                                   rope_tables)

#: plan codes per sub-layer (column 0 Attention, column 1 MLP)
DENSE, BUDGET, SKIP = 0, 1, 2


def choice_weights(t_attn: float, t_attn_budget: float, t_mlp: float, cap: int = WEIGHT_CAP) -> Tuple[int, int, int]:
    """``(w_attn, w_budget, w_mlp)``: the two-choice weights (:func:`~jaxspec.knapspec.knapsack.knapsack_weights`)
    and the budgeted Attention's weight ``round(t_attn_budget / lighter)`` clipped to ``0 .. w_attn``."""
    w_attn, w_mlp = knapsack_weights(t_attn, t_mlp, cap)
    lighter = max(min(float(t_attn), float(t_mlp)), 1e-30)
    w_budget = int(min(max(int(round(float(t_attn_budget) / lighter)), 0), w_attn))
    return w_attn, w_budget, w_mlp


def sink_window_indices(lengths, sinks: int, window: int) -> jax.Array:
    """History slots ``[B, sinks + window]`` of the budget: ``0 .. sinks-1`` and ``lengths-window ..
    lengths-1`` (negative or repeated slots are masked by the attention: a short history is attended
    whole, once)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    head = jnp.broadcast_to(jnp.arange(sinks, dtype=jnp.int32), lengths.shape + (sinks,))
    tail = lengths[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None, :]
    return jnp.concatenate([head, tail], axis=1)


def check_budget(sinks: int, window: int) -> None:
    if int(sinks) < 0 or int(window) < 1:
        raise ValueError(f"attention budget sinks={sinks}, window={window}: need sinks >= 0 and window >= 1")


# ---------------------------------------------------------------------------- the DP
@dataclasses.dataclass
class ChoiceTrace(FinalSlots):
    """Per scanned layer ``k`` (model layer ``first_layer + k``) and column ``c``: ``values[k, c, j]``
    (sum of cosines, ``-inf`` empty), ``choice[k, c, j]`` (the code that filled the slot) and
    ``valid[k, c, j]``."""

    values: np.ndarray  # [n, 2, J]
    choice: np.ndarray  # [n, 2, J] int
    valid: np.ndarray  # [n, 2, J] bool
    first_layer: int = 1


def _shift(x, by: int, num_slots: int, fill=None):
    """Slot ``j`` of the result holds slot ``j - by`` of ``x``; below ``by``: ``fill`` (None: finite
    copies of ``x``'s first slots, never marked valid)."""
    if by == 0:
        return x
    pad = x[:by] if fill is None else jnp.full((by,) + x.shape[1:], fill, x.dtype)
    return jnp.concatenate([pad, x[: num_slots - by]], axis=0)


def choice_transition(g, valid, options, target, token_mask, denom, *, budget: int, tau: float):
    """One sub-layer for all slots: ``options`` a list of ``(code, states [J, ...], saved weight, allowed)``
    in preference order (a later option replaces an earlier one only if strictly better)."""
    num_slots = budget + 1
    best_val = jnp.full((num_slots,), -jnp.inf, jnp.float32)
    best_ok = jnp.zeros((num_slots,), bool)
    best_state = g
    best_code = jnp.zeros((num_slots,), jnp.int8)
    for code, states, saved, allowed in options:
        if saved > budget:
            continue
        val = _shift(cos_sum(states, target, token_mask), saved, num_slots, -jnp.inf)
        src = _shift(valid, saved, num_slots, False)
        state = _shift(states, saved, num_slots)
        ok = allowed & src & (val / denom >= tau)
        take = ok & (~best_ok | (val > best_val))
        pick = take.reshape((-1,) + (1,) * (g.ndim - 1))
        best_state = jnp.where(pick, state, best_state)
        best_val = jnp.where(take, val, best_val)
        best_code = jnp.where(take, jnp.int8(code), best_code)
        best_ok = best_ok | ok
    return best_state, best_ok, jnp.where(best_ok, best_val, -jnp.inf), best_code


def dp_scan_choices(apply_attn: Callable, apply_attn_budget: Callable, apply_mlp: Callable, layer_xs, g0, targets,
                    can_skip, token_mask, *, w_attn: int, w_budget: int, w_mlp: int, budget: int,
                    tau: float = DEFAULT_TAU):
    """The three-choice DP as one ``lax.scan`` over ``n`` layers, vectorised over ``J = budget + 1``
    slots (arguments as :func:`jaxspec.knapspec.knapsack.dp_scan`, plus ``apply_attn_budget`` the budgeted
    Attention on all slots). Returns ``(values, choice, valid [n, 2, J], final states [J, ...])``."""
    num_slots = budget + 1
    g = jnp.broadcast_to(g0[None], (num_slots,) + g0.shape)
    valid = jnp.arange(num_slots) == 0
    denom = jnp.maximum(jnp.sum(jnp.asarray(token_mask, jnp.float32)), 1.0)
    step = functools.partial(choice_transition, token_mask=token_mask, denom=denom, budget=budget, tau=tau)
    yes = jnp.asarray(True)

    def body(carry, xs):
        g, valid = carry
        layer_x, target, skip_ok = xs
        attn = [(DENSE, apply_attn(layer_x, g), 0, yes)]
        if w_attn - w_budget <= budget:
            attn.append((BUDGET, apply_attn_budget(layer_x, g), w_attn - w_budget, yes))
        attn.append((SKIP, g, w_attn, skip_ok[0]))
        g1, v1, val1, c1 = step(g, valid, attn, target[0])
        g2, v2, val2, c2 = step(g1, v1, [(DENSE, apply_mlp(layer_x, g1), 0, yes), (SKIP, g1, w_mlp, skip_ok[1])],
                                target[1])
        return (g2, v2), (jnp.stack([val1, val2]), jnp.stack([c1, c2]), jnp.stack([v1, v2]))

    (g, valid), (values, choice, valids) = jax.lax.scan(body, (g, valid),
                                                        (layer_xs, targets, per_sublayer_can_skip(can_skip)))
    return values, choice, valids, g


def brute_force_choices(apply_single: Callable, layers: Sequence[Any], g0, targets, can_skip, token_mask, *,
                        w_attn: int, w_budget: int, w_mlp: int, budget: int,
                        tau: float = DEFAULT_TAU) -> Dict[int, Tuple[float, Tuple[Tuple[int, int, int], ...]]]:
    """Every plan (same pruning at every depth, same budget, same fixed edges): ``{saved weight: (best
    final value, ((layer index, column, code), ...) of the non-dense sub-layers)}``; ``apply_single(kind,
    layer_x, h)`` with kind 0 dense Attention, 1 MLP, 2 budgeted Attention. The exploration order is the
    DP's preference order, and the first plan found wins ties."""
    n = len(layers)
    denom = max(float(np.sum(np.asarray(token_mask, np.float32))), 1.0)
    best: Dict[int, Tuple[float, Tuple[Tuple[int, int, int], ...]]] = {}

    def visit(k, h, weight, plan, value):
        if k == 2 * n:
            if value > best.get(weight, (-np.inf,))[0]:
                best[weight] = (value, plan)
            return
        layer, col = divmod(k, 2)
        target = targets[layer][col]
        if col == 0:
            options = [(DENSE, lambda: apply_single(0, layers[layer], h), 0, True),
                       (BUDGET, lambda: apply_single(2, layers[layer], h), w_attn - w_budget, True),
                       (SKIP, lambda: h, w_attn, sublayer_can_skip(can_skip, layer, 0))]
        else:
            options = [(DENSE, lambda: apply_single(1, layers[layer], h), 0, True),
                       (SKIP, lambda: h, w_mlp, sublayer_can_skip(can_skip, layer, 1))]
        for code, make, saved, allowed in options:
            if not allowed or weight + saved > budget:
                continue
            state = make()
            v = float(cos_sum(state, target, token_mask))
            if v / denom >= tau:
                visit(k + 1, state, weight + saved, plan + (((layer, col, code),) if code != DENSE else ()), v)

    if n == 0:
        return {0: (float(cos_sum(g0, g0, token_mask)), ())}
    visit(0, g0, 0, (), -np.inf)
    return best


def backtrack_choices(trace: ChoiceTrace, num_layers: int, w_attn: int, w_budget: int,
                      w_mlp: int) -> Tuple[np.ndarray, np.ndarray]:
    """Plans ``[C, L, 2]`` int8 (:data:`DENSE` / :data:`BUDGET` / :data:`SKIP`) of the surviving final
    slots, and those slots ``[C]``."""
    saved = {(0, DENSE): 0, (0, BUDGET): w_attn - w_budget, (0, SKIP): w_attn, (1, DENSE): 0, (1, SKIP): w_mlp}
    slots = np.nonzero(trace.final_valid)[0]
    plans = np.zeros((len(slots), num_layers, 2), np.int8)
    n = trace.values.shape[0]
    for c, slot in enumerate(slots):
        j = int(slot)
        for k in range(2 * n - 1, -1, -1):
            layer, col = divmod(k, 2)
            if not trace.valid[layer, col, j]:
                raise AssertionError(f"backtrack reached an empty slot (layer {layer}, column {col}, j={j})")
            code = int(trace.choice[layer, col, j])
            plans[c, trace.first_layer + layer, col] = code
            j -= saved[(col, code)]
        if j != 0:
            raise AssertionError(f"backtrack of slot {slot} ended at weight {j}, not 0")
    return plans, slots


# ---------------------------------------------------------------------------- on the model
def _sublayers(config: ModelConfig, prefix_len, steps: int, sinks: int, window: int):
    cos, sin = rope_tables(config, default_positions(prefix_len.astype(jnp.int32), steps))
    indices = sink_window_indices(prefix_len, sinks, window)

    def attn(layer_x, h, budgeted: bool):
        layer, cache_k, cache_v = layer_x
        return attention_sublayer(layer, h, config, cos, sin, cache_k, cache_v, prefix_len,
                                  indices if budgeted else None).hidden

    def mlp(layer_x, h):
        return mlp_sublayer(layer_x[0], h, config)

    return attn, mlp


@dataclasses.dataclass
class ChoiceCandidates:
    """The three-choice DP's output: one plan per surviving final slot (ascending saved weight)."""

    plans: np.ndarray  # [C, L, 2] int8 codes
    weights: np.ndarray  # [C] saved weight
    cosine: np.ndarray  # [C] mean cosine with the target's final state
    alpha: np.ndarray  # [C] greedy agreement with the target on the reference tokens
    w_attn: int
    w_budget: int
    w_mlp: int
    budget: int
    sinks: int
    window: int
    trace: Optional[ChoiceTrace] = None
    final_states: Any = None

    def __len__(self) -> int:
        return len(self.weights)

    @property
    def masks(self) -> np.ndarray:
        """``[C, L, 2]`` bool: the skipped sub-layers."""
        return self.plans == SKIP


def _choice_dp_fn(params, stacked, cache: KVCache, prefix_len, states, token_mask, *, config, w_attn, w_budget, w_mlp,
                  budget, tau, sinks, window):
    num_layers = config.num_layers
    attn, mlp = _sublayers(config, prefix_len, states.shape[2], sinks, window)
    layer_xs = (stacked, jnp.stack(cache.keys[1:]), jnp.stack(cache.values[1:]))
    targets = states[3:].reshape((num_layers - 1, 2) + states.shape[1:])
    can_skip = jnp.arange(1, num_layers) < num_layers - 1

    def attn_all(layer_x, g):  # branch-parallel over the shared prefix cache
        return jax.vmap(lambda h: attn(layer_x, h, False))(g)

    def attn_budget_all(layer_x, g):
        return jax.vmap(lambda h: attn(layer_x, h, True))(g)

    def mlp_all(layer_x, g):
        return mlp(layer_x, g.reshape((-1,) + g.shape[2:])).reshape(g.shape)

    values, choice, valid, final = dp_scan_choices(attn_all, attn_budget_all, mlp_all, layer_xs, states[2], targets,
                                                   can_skip, token_mask, w_attn=w_attn, w_budget=w_budget,
                                                   w_mlp=w_mlp, budget=budget, tau=tau)
    teacher = jnp.argmax(lm_head(params, states[-1], config), -1)
    mask = jnp.asarray(token_mask, jnp.float32)
    alpha = jax.lax.map(lambda s: jnp.sum((jnp.argmax(lm_head(params, s, config), -1) == teacher) * mask), final,
                        batch_size=8) / jnp.maximum(jnp.sum(mask), 1.0)
    return values, choice, valid, alpha, final


_choice_dp = jax.jit(_choice_dp_fn, static_argnames=("config", "w_attn", "w_budget", "w_mlp", "budget", "tau",
                                                      "sinks", "window"))


def knapsack_dp_choices(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *,
                        w_attn: int, w_budget: int, w_mlp: int, sinks: int, window: int,
                        budget: Optional[int] = None, tau: float = DEFAULT_TAU,
                        keep_states: bool = False) -> ChoiceCandidates:
    """The jit-compiled three-choice DP on the model (arguments as
    :func:`jaxspec.knapspec.dp.knapsack_dp`; ``sinks`` + ``window`` the budgeted Attention's history)."""
    check_budget(sinks, window)
    config = dp_config(config)
    budget = skip_budget(w_attn, w_mlp, config.num_layers) if budget is None else int(budget)
    token_mask = (jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None
                  else jnp.asarray(token_mask, jnp.float32))
    if config.num_layers < 2:
        raise ValueError(f"num_layers={config.num_layers}: the three-choice DP needs at least 2 layers")
    outer = params.replace(layers=())
    values, choice, valid, alpha, final = _choice_dp(
        outer, stacked_scan_layers(params), cache, jnp.asarray(prefix_len, jnp.int32), states, token_mask,
        config=config, w_attn=int(w_attn), w_budget=int(w_budget), w_mlp=int(w_mlp), budget=budget, tau=float(tau),
        sinks=int(sinks), window=int(window))
    trace = ChoiceTrace(np.asarray(values, np.float64), np.asarray(choice), np.asarray(valid))
    plans, slots = backtrack_choices(trace, config.num_layers, w_attn, w_budget, w_mlp)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    return ChoiceCandidates(plans=plans, weights=slots, cosine=trace.final_values[slots] / denom,
                            alpha=np.asarray(alpha, np.float64)[slots], w_attn=int(w_attn), w_budget=int(w_budget),
                            w_mlp=int(w_mlp), budget=budget, sinks=int(sinks), window=int(window), trace=trace,
                            final_states=np.asarray(final)[slots] if keep_states else None)


def freeze_plan(plan) -> Tuple[Tuple[int, int], ...]:
    """``[L, 2]`` codes -> the static form ``((attn code, mlp code), ...)``."""
    return tuple((int(a), int(m)) for a, m in np.asarray(plan, np.int64))


def budgeted_forward(params, tokens, cache: KVCache, *, config: ModelConfig, plan: Tuple[Tuple[int, int], ...],
                     sinks: int, window: int, return_hidden: bool = False):
    """The forward of ``tokens [B, T]`` under a static ``plan`` (:func:`freeze_plan`): skipped sub-layers
    removed at trace time, budgeted Attention over the ``sinks + window`` history slots
    (:func:`sink_window_indices` at the cache lengths) plus the new tokens. Returns ``(logits [B, T, V],
    cache, hidden or None)``; every executed Attention writes its K/V, as the forward does."""
    lengths = cache.lengths
    history = cache.read_lengths  # what the attention reads: 1 slot for a frozen (finished) row
    steps = tokens.shape[1]
    cos, sin = rope_tables(config, default_positions(lengths, steps))
    indices = sink_window_indices(lengths, sinks, window)
    h = embed(params, tokens, config)
    keys, values = list(cache.keys), list(cache.values)
    for i, layer in enumerate(params.layers):
        attn_code, mlp_code = plan[i]
        out = decoder_layer(layer, h, config, cos, sin, cache.keys[i], cache.values[i], lengths,
                            indices if attn_code == BUDGET else None, skip_attn=attn_code == SKIP,
                            skip_mlp=mlp_code == SKIP, history_lengths=history)
        h, keys[i], values[i] = out.hidden, out.cache_k, out.cache_v
    logits = lm_head(params, h, config)
    new_cache = KVCache(keys=tuple(keys), values=tuple(values), lengths=lengths + steps, frozen=cache.frozen)
    return logits, new_cache, (h if return_hidden else None)


budgeted_forward_jit = jax.jit(budgeted_forward, static_argnames=("config", "plan", "sinks", "window",
                                                                  "return_hidden"))


def plan_draft_time(plan, latency: LatencyModel, n: float, budget_tokens: int) -> float:
    """Latency model of one draft forward under ``plan``: dense Attention ``t_attn(n)``, budgeted
    ``t_attn(min(K, n))``, executed MLP ``t_mlp``, plus ``t_token(n)``."""
    plan = np.asarray(plan)
    dense = int(np.sum(plan[:, 0] == DENSE))
    budgeted = int(np.sum(plan[:, 0] == BUDGET))
    mlps = int(np.sum(plan[:, 1] != SKIP))
    return (dense * latency.t_attn(n) + budgeted * latency.t_attn(min(float(budget_tokens), float(n)))
            + mlps * latency.t_mlp() + latency.t_token(n))


class BudgetDPCost:
    """The three-choice DP's price per reference token (docs/methods.md §5.4), for the planning
    allowance (:func:`jaxspec.knapspec.skip_planner.reference_allowance`): like the two-choice DP (§5.6) it
    runs every saved-weight slot state (skip budget + 1 under :func:`choice_weights`) of each reference
    token through the model, each slot a row at the latency model's many-row price ``t_row(n)``
    (else ``v t_step``); the budgeted branch over ``sinks + window`` slots is not priced apart."""

    def __init__(self, latency: LatencyModel, sinks: int, window: int, weight_cap: int = WEIGHT_CAP):
        self.latency, self.sinks, self.window, self.weight_cap = latency, int(sinks), int(window), int(weight_cap)

    def slots(self, config: ModelConfig, n: float) -> int:
        lat = self.latency
        w_attn, _, w_mlp = choice_weights(lat.t_attn(n), lat.t_attn(min(float(self.sinks + self.window), float(n))),
                                          lat.t_mlp(), self.weight_cap)
        return skip_budget(w_attn, w_mlp, config.num_layers) + 1

    def reference_cost(self, config: ModelConfig, n: float) -> float:
        return float(self.slots(config, n)) * self.latency.t_extra_row(n, config.num_layers)


def plan_choices(target_params, config: ModelConfig, cache, tokens, token_mask, prefix_len, latency: LatencyModel,
                 n: float, *, sinks: int, window: int, tau: float = DEFAULT_TAU, weight_cap: int = WEIGHT_CAP,
                 gammas: Sequence[int] = tuple(range(1, 11)), exclude_full: bool = True):
    """Stage 1 (the three-choice DP) and stage 2 (the TPT grid search of docs/methods.md §4.2 over
    (candidate, gamma) with :func:`plan_draft_time`): ``(best {index, gamma, tpt, plan}, candidates,
    weights)``."""
    check_budget(sinks, window)
    t_attn, t_mlp = latency.t_attn(n), latency.t_mlp()
    weights = choice_weights(t_attn, latency.t_attn(min(float(sinks + window), float(n))), t_mlp, weight_cap)
    states = boundary_states(target_params, config, tokens, cache, prefix_len)
    cands = knapsack_dp_choices(target_params, config, cache, prefix_len, states, token_mask, w_attn=weights[0],
                                w_budget=weights[1], w_mlp=weights[2], sinks=sinks, window=window, tau=tau)
    t_target = latency.t_step(n, config.num_layers)
    best = None
    for c in range(len(cands)):
        if exclude_full and len(cands) > 1 and not (cands.plans[c] != DENSE).any():
            continue
        t_draft = plan_draft_time(cands.plans[c], latency, n, sinks + window)
        for gamma in gammas:
            score = float(tpt(cands.alpha[c], gamma, t_draft, t_target, latency.v, latency.a,
                              plain=latency.plain_ratio))
            if best is None or score > best["tpt"]:
                best = {"index": c, "gamma": int(gamma), "tpt": score, "plan": cands.plans[c]}
    return best, cands, weights


__all__ = ["BUDGET", "DENSE", "SKIP", "BudgetDPCost", "ChoiceCandidates", "ChoiceTrace", "backtrack_choices", "brute_force_choices",
           "budgeted_forward", "budgeted_forward_jit", "check_budget", "choice_transition", "choice_weights",
           "dp_scan_choices", "freeze_plan", "knapsack_dp_choices", "plan_choices", "plan_draft_time",
           "sink_window_indices"]
