"""The KnapSpec knapsack DP over sub-layers, independent of the model (docs/methods.md §4.3, defaults of the
official code).

Items are the ``2L`` sub-layers (Attention, MLP of each layer). Integer weights: the heavier
of ``(t_attn(n), t_mlp)`` over the lighter, rounded (Python ``round``), capped at 5; the
lighter weighs 1. Skip budget ``floor((w_attn + w_mlp) * L / 2)``; slots ``j = 0 .. budget``
hold the *exact* skipped weight.

Reference: the target's residual stream ``x_0 .. x_2L`` at the ``2L + 1`` sub-layer boundaries
for ``r`` committed tokens (``x_0`` the embeddings, ``x_{2l+1}`` after Attention ``l``,
``x_{2l+2}`` after MLP ``l``). State ``g[i][j]``: the best candidate hidden state (for all
``r`` tokens) after sub-layer ``i`` with skipped weight ``j``; its value is
``v[i][j] = sum_tokens cos(g[i][j], x_i)`` (the cosine at depth ``i`` only, as in the
official code). Transition for sub-layer ``i`` (weight ``w_i``)::

    execute: candidate f_i(g[i-1][j])  -> slot j
    skip:    candidate g[i-1][j]       -> slot j + w_i     (not for layers 0 and L-1)

A sub-layer may also be kept from skipping (``keep_attention``: layers whose Attention
sub-layer every candidate executes, e.g. a self-draft's Dustin SRH layers, docs/methods.md §5.5);
``can_skip`` is then per sub-layer, ``[n, 2]``, instead of per layer.

A candidate whose *mean* cosine is ``< tau`` is pruned; each slot keeps the candidate of
highest value (execute first; a skip replaces it only if strictly better). Layer 0 is always
executed, so the DP starts at boundary 2 with ``g[2][0] = x_2``. Every surviving final slot
is backtracked to an ``[L, 2]`` skip mask (column 0 Attention, column 1 MLP).

The DP is a heuristic: it keeps one state per (depth, weight), so it is exact only when the
objective has optimal substructure (a prefix that is better at depth ``i`` stays better after
any common suffix, at every later depth) -- see ``tests/knapspec/test_knapspec.py`` for an instance
where that holds and the DP equals exhaustive search over all skip sets.

Implementations (same semantics, same result), each given the sub-layers as functions, so that
:mod:`jaxspec.knapspec.dp` runs them on the model:

* :func:`dp_scan` -- ``jax.lax.scan`` over layers (two sub-layer transitions per step),
  vectorised over all ``J = budget + 1`` slots: the sub-layer is applied to all ``J`` states
  as one batch, in runs of layers over the slots each run can reach (:func:`slot_segments`);
* :func:`dp_unrolled` -- the same vectorised transitions traced once per layer, each sub-layer on the
  slots it can reach;
* :func:`dp_loop` -- a plain Python loop over sub-layers and budgets, one candidate state at a
  time (the official algorithm's structure): the reference the scan is tested against;
* :func:`brute_force` -- depth-first enumeration of every skip set (same fixed edge layers,
  same pruning at every depth, same budget): the exact optimum per skipped weight.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

#: Default pruning threshold on the mean cosine (official code: sim_threshold = 0.5).
DEFAULT_TAU = 0.5
#: Cap of the integer weight ratio (official code: 5).
WEIGHT_CAP = 5
#: Runs of layers the DP's scan is split into, each over the slots it can reach (:func:`slot_segments`).
DEFAULT_SEGMENTS = 4
#: How the DP walks the layers (:func:`knapsack_dp` ``layers``): one ``lax.scan`` over stacked layer weights
#: (:func:`dp_scan`, the default) or a loop traced once per layer on the model's own weights (:func:`dp_unrolled`).
DP_LAYERS = ("scan", "unrolled")
_EPS = 1e-12  # torch.nn.functional.normalize's eps
#: How the DP's reference tokens see one another (docs/methods.md §4.3): ``"branch"`` (the paper's and
#: the authors' code: the r tokens go through each candidate as one causal sequence, so token i attends
#: to the candidate's own K/V of tokens < i and errors compound along the window) or ``"target"``
#: (token i attends to the *target's* K/V of tokens < i and to the candidate's only at its own
#: position: what a draft step sees when the tokens before it are committed, as with gamma = 1).
REFERENCE_KV = ("branch", "target")


# ---------------------------------------------------------------------------- weights
def knapsack_weights(t_attn: float, t_mlp: float, cap: int = WEIGHT_CAP) -> Tuple[int, int]:
    """``(w_attn, w_mlp)``: heavier / lighter rounded (Python ``round``) and capped; lighter = 1."""
    t_attn = max(float(t_attn), 1e-30)
    t_mlp = max(float(t_mlp), 1e-30)
    if t_attn > t_mlp:
        return max(1, min(int(round(t_attn / t_mlp)), cap)), 1
    return 1, max(1, min(int(round(t_mlp / t_attn)), cap))


def skip_budget(w_attn: int, w_mlp: int, num_layers: int) -> int:
    """``floor((w_attn + w_mlp) * L / 2)``."""
    return (int(w_attn) + int(w_mlp)) * int(num_layers) // 2


# ---------------------------------------------------------------------------- value
def cos_sum(states, target, token_mask):
    """Sum over tokens of ``cos(states, target)``.

    ``states [..., *T, H]``, ``target [*T, H]``, ``token_mask [*T]`` (1 = a reference token,
    0 = padding) -> ``[...]`` float32 (the leading dims of ``states`` are kept).
    """
    s = states.astype(jnp.float32)
    t = target.astype(jnp.float32)
    dot = jnp.sum(s * t, axis=-1)
    ns = jnp.sqrt(jnp.sum(s * s, axis=-1))
    nt = jnp.sqrt(jnp.sum(t * t, axis=-1))
    cos = dot / (jnp.maximum(ns, _EPS) * jnp.maximum(nt, _EPS))
    mask = jnp.asarray(token_mask, jnp.float32)
    lead = cos.ndim - mask.ndim
    return jnp.sum(cos * mask, axis=tuple(range(lead, cos.ndim)))


# ---------------------------------------------------------------------------- trace
class FinalSlots:
    """The last sub-layer's slots of a trace with ``values`` and ``valid`` ``[n, 2, J]``: what backtracking starts
    from (:class:`DPTrace`, and the budgeted DP's :class:`~jaxspec.knapspec.budgeted.ChoiceTrace`)."""

    values: np.ndarray
    valid: np.ndarray

    @property
    def final_valid(self) -> np.ndarray:
        return self.valid[-1, 1]

    @property
    def final_values(self) -> np.ndarray:
        return self.values[-1, 1]


@dataclasses.dataclass
class DPTrace(FinalSlots):
    """Per scanned layer ``k`` (model layer ``first_layer + k``) and sub-layer ``c`` (0 attn, 1 mlp):
    ``values[k, c, j]`` (sum of cosines, ``-inf`` where the slot is empty), ``skipped[k, c, j]``
    (the slot's state came from the skip transition) and ``valid[k, c, j]``."""

    values: np.ndarray  # [n, 2, J] float
    skipped: np.ndarray  # [n, 2, J] bool
    valid: np.ndarray  # [n, 2, J] bool
    first_layer: int = 1


def transition(g, valid, executed, target, token_mask, denom, *, w: int, skip_allowed, budget: int, tau: float):
    """One sub-layer of the DP for all slots at once. ``g``/``executed`` ``[J, ...]``."""
    num_slots = budget + 1
    exec_val = cos_sum(executed, target, token_mask)
    exec_ok = valid & (exec_val / denom >= tau)
    if w <= budget:
        prev_val = cos_sum(g, target, token_mask)  # a skipped sub-layer leaves the state unchanged
        skip_val = jnp.concatenate([jnp.full((w,), -jnp.inf, prev_val.dtype), prev_val[: num_slots - w]])
        skip_src = jnp.concatenate([jnp.zeros((w,), bool), valid[: num_slots - w]])
        skip_state = jnp.concatenate([g[:w], g[: num_slots - w]], axis=0)
        skip_ok = skip_allowed & skip_src & (skip_val / denom >= tau)
    else:
        skip_val = jnp.full_like(exec_val, -jnp.inf)
        skip_state = g
        skip_ok = jnp.zeros_like(exec_ok)
    choose_skip = skip_ok & (~exec_ok | (skip_val > exec_val))
    new_valid = exec_ok | skip_ok
    pick = choose_skip.reshape((-1,) + (1,) * (g.ndim - 1))
    new_g = jnp.where(pick, skip_state, executed)
    new_val = jnp.where(choose_skip, skip_val, jnp.where(exec_ok, exec_val, -jnp.inf))
    return new_g, new_valid, new_val, choose_skip


def sublayer_can_skip(can_skip, k: int, col: int) -> bool:
    """Entry ``(k, col)`` of a ``can_skip`` given per layer ``[n]`` or per sub-layer ``[n, 2]``."""
    entry = np.asarray(can_skip[k], bool)
    return bool(entry) if entry.ndim == 0 else bool(entry[col])


def per_sublayer_can_skip(can_skip):
    """``can_skip`` as ``[n, 2]`` bool (Attention, MLP) from per layer ``[n]`` or per sub-layer ``[n, 2]``."""
    can_skip = jnp.asarray(can_skip, bool)
    return jnp.stack([can_skip, can_skip], axis=1) if can_skip.ndim == 1 else can_skip


def check_keep_attention(keep_attention, num_layers: int) -> Tuple[int, ...]:
    """``keep_attention`` as a sorted tuple of distinct layers, each in ``0 .. num_layers - 1`` (else a
    ValueError naming the bad ones)."""
    keep = tuple(sorted({int(x) for x in keep_attention}))
    bad = [x for x in keep if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"keep_attention layers {bad} out of range: the model has layers 0..{num_layers - 1}")
    return keep


def scan_can_skip(num_layers: int, keep_attention: Tuple[int, ...] = ()) -> np.ndarray:
    """``[L - 1, 2]`` bool: which sub-layers of layers ``1 .. L-1`` (the scanned ones) the DP may skip --
    all but layer ``L - 1``'s and the Attention of the ``keep_attention`` layers."""
    can = np.ones((num_layers - 1, 2), bool)
    can[-1] = False
    for layer in keep_attention:
        if layer >= 1:
            can[layer - 1, 0] = False
    return can


def slot_segments(can_skip, w_attn: int, w_mlp: int, budget: int, max_segments: int = 1) -> Tuple[Tuple[int, int], ...]:
    """How :func:`dp_scan` splits the ``n`` scanned layers: ``((layers, slots), ...)``, at most ``max_segments``
    runs of consecutive layers, each run carrying only the slots its last layer can reach. Before layer ``t`` at
    most the skippable weight of the layers before it can have been skipped, so the slots above it are empty
    (docs/methods.md §4.3): a run of layers ``a .. b-1`` needs ``min(budget, reach(b-1)) + 1`` slots. The split
    minimises the slot-layers computed (exact, by a small DP over the ``n`` layers); one run of every slot when
    ``max_segments`` is 1 or splitting saves nothing. ``can_skip`` as :func:`dp_scan` takes it, concrete."""
    can = np.asarray(can_skip, bool)
    can = np.stack([can, can], axis=1) if can.ndim == 1 else can
    n = len(can)
    need = np.minimum(np.cumsum(can[:, 0] * int(w_attn) + can[:, 1] * int(w_mlp)), int(budget)) + 1
    full = ((n, int(budget) + 1),)
    if max_segments <= 1 or n == 0:
        return full
    inf = float("inf")
    # cost[k][b]: the fewest slot-layers for layers 0..b-1 in k runs; a run a..b-1 costs (b - a) * need[b - 1]
    cost = [[inf] * (n + 1) for _ in range(max_segments + 1)]
    cut = [[0] * (n + 1) for _ in range(max_segments + 1)]
    cost[0][0] = 0.0
    for k in range(1, max_segments + 1):
        for b in range(1, n + 1):
            for a in range(b):
                c = cost[k - 1][a] + (b - a) * int(need[b - 1])
                if c < cost[k][b]:
                    cost[k][b], cut[k][b] = c, a
    k = min(range(1, max_segments + 1), key=lambda i: (cost[i][n], i))
    runs, b = [], n
    while b > 0:
        a = cut[k][b]
        runs.append((b - a, int(need[b - 1])))
        b, k = a, k - 1
    runs = tuple(reversed(runs))
    return runs if len(runs) > 1 or runs[0][1] < int(budget) + 1 else full


def dp_scan(apply_attn: Callable, apply_mlp: Callable, layer_xs, g0, targets, can_skip, token_mask, *,
            w_attn: int, w_mlp: int, budget: int, tau: float = DEFAULT_TAU,
            segments: Optional[Tuple[Tuple[int, int], ...]] = None):
    """The DP as a ``lax.scan`` over ``n`` layers, vectorised over the ``J = budget + 1`` slots.

    ``apply_attn(layer_x, g [J, *T, H]) -> [J, *T, H]`` (likewise ``apply_mlp``) apply one
    sub-layer to all slot states at once; ``layer_xs`` is a pytree with leading axis ``n`` (one
    entry per scanned layer); ``g0 [*T, H]`` the state before the first scanned layer (slot 0);
    ``targets [n, 2, *T, H]`` the reference states after each scanned sub-layer;
    ``can_skip [n]`` bool (per layer) or ``[n, 2]`` (per sub-layer: Attention, MLP); ``token_mask [*T]``.
    ``segments``: :func:`slot_segments` (static): consecutive runs of layers, each scanned with only the
    slots it can reach (the empty slots above are neither computed nor changed: the same result); None =
    one scan of every slot.

    Returns ``(values [n, 2, J], skipped [n, 2, J], valid [n, 2, J], final states [J, *T, H])``; a segmented
    scan leaves the empty slots' final states at ``g0`` where one scan leaves whatever it computed there
    (traceable: call it inside ``jit``).
    """
    num_slots = budget + 1
    n = targets.shape[0]
    segments = tuple(segments) if segments is not None else ((n, num_slots),)
    if sum(c for c, _ in segments) != n or any(s < 1 or s > num_slots for _, s in segments):
        raise ValueError(f"segments {segments}: the runs must cover the {n} scanned layers, each with 1..{num_slots} "
                         f"slots")
    denom = jnp.maximum(jnp.sum(jnp.asarray(token_mask, jnp.float32)), 1.0)
    can_skip = per_sublayer_can_skip(can_skip)

    def pad_slots(x, slots, fill):  # [J', ...] -> [slots, ...], the new slots holding `fill`
        extra = slots - x.shape[0]
        return x if extra <= 0 else jnp.concatenate([x, jnp.broadcast_to(fill, (extra,) + x.shape[1:])], axis=0)

    g = jnp.broadcast_to(g0[None], (segments[0][1],) + g0.shape)  # empty slots hold finite copies
    valid = jnp.arange(segments[0][1]) == 0
    outs, start = [], 0
    for count, slots in segments:
        g, valid = pad_slots(g, slots, g0), pad_slots(valid, slots, False)
        step = functools.partial(transition, token_mask=token_mask, denom=denom, budget=slots - 1, tau=tau)

        def body(carry, i, step=step):
            g, valid = carry
            layer_x = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), layer_xs)
            target = jax.lax.dynamic_index_in_dim(targets, i, keepdims=False)
            skip_ok = jax.lax.dynamic_index_in_dim(can_skip, i, keepdims=False)
            g1, v1, val1, ch1 = step(g, valid, apply_attn(layer_x, g), target[0], w=w_attn, skip_allowed=skip_ok[0])
            g2, v2, val2, ch2 = step(g1, v1, apply_mlp(layer_x, g1), target[1], w=w_mlp, skip_allowed=skip_ok[1])
            return (g2, v2), (jnp.stack([val1, val2]), jnp.stack([ch1, ch2]), jnp.stack([v1, v2]))

        (g, valid), (values, skipped, valids) = jax.lax.scan(body, (g, valid), jnp.arange(start, start + count))
        pad = ((0, 0), (0, 0), (0, num_slots - slots))
        outs.append((jnp.pad(values, pad, constant_values=-jnp.inf), jnp.pad(skipped, pad), jnp.pad(valids, pad)))
        start += count
    values, skipped, valids = (jnp.concatenate(parts, axis=0) for parts in zip(*outs))
    return values, skipped, valids, pad_slots(g, num_slots, g0)  # slots no run reached: empty


def dp_unrolled(apply_attn: Callable, apply_mlp: Callable, layer_args: Sequence[Any], g0, targets, can_skip,
                token_mask, *, w_attn: int, w_mlp: int, budget: int, tau: float = DEFAULT_TAU):
    """The DP of :func:`dp_scan` as a Python loop over the ``n`` layers, traced once each: ``layer_args[k]`` is
    layer ``k``'s own argument (its weights and cache arrays as they are, not slices of a stacked copy), and each
    sub-layer runs on exactly the slots it can reach (slot ``j`` holds skipped weight ``j``, so before a sub-layer
    only the slots up to the skippable weight of the sub-layers before it can hold a state). The same
    transitions, so the same trace and states (tested); what differs is what XLA gets: a scan body reads its
    layer by dynamic slicing, which a CPU pays as a copy of that layer's weights every iteration, and needs
    every layer's weights stacked into one more copy beside the model's. ``targets [n, 2, *T, H]``,
    ``can_skip`` as :func:`dp_scan` takes it, concrete. Returns what :func:`dp_scan` returns (empty slots'
    final states at ``g0``; traceable: call it inside ``jit``)."""
    num_slots = budget + 1
    n = len(layer_args)
    if targets.shape[0] != n:
        raise ValueError(f"{n} layer arguments for {targets.shape[0]} scanned layers of targets")
    can = np.asarray(can_skip, bool)
    can = np.stack([can, can], axis=1) if can.ndim == 1 else can  # concrete: the loop reads it while tracing
    denom = jnp.maximum(jnp.sum(jnp.asarray(token_mask, jnp.float32)), 1.0)

    def pad(x, slots, fill):  # [J', ...] -> [slots, ...], the new slots holding `fill`
        extra = slots - x.shape[0]
        return x if extra <= 0 else jnp.concatenate([x, jnp.broadcast_to(fill, (extra,) + x.shape[1:])], axis=0)

    g, valid, slots = g0[None], jnp.ones((1,), bool), 1
    values, skipped, valids = [], [], []
    for k in range(n):
        per_sub = []
        for c, (apply, w) in enumerate(((apply_attn, int(w_attn)), (apply_mlp, int(w_mlp)))):
            reach = min(slots + (w if can[k, c] else 0), num_slots)
            executed = pad(apply(layer_args[k], g), reach, g0)  # the empty slots above are invalid: not computed
            g, valid, val, choice = transition(pad(g, reach, g0), pad(valid, reach, False), executed, targets[k, c],
                                                token_mask, denom, w=w, skip_allowed=bool(can[k, c]),
                                                budget=reach - 1, tau=tau)
            slots = reach
            per_sub.append((pad(val, num_slots, -jnp.inf), pad(choice, num_slots, False), pad(valid, num_slots, False)))
        values.append(jnp.stack([x[0] for x in per_sub]))
        skipped.append(jnp.stack([x[1] for x in per_sub]))
        valids.append(jnp.stack([x[2] for x in per_sub]))
    return jnp.stack(values), jnp.stack(skipped), jnp.stack(valids), pad(g, num_slots, g0)


def dp_loop(apply_single: Callable, layers: Sequence[Any], g0, targets, can_skip, token_mask, *, w_attn: int,
            w_mlp: int, budget: int, tau: float = DEFAULT_TAU, first_layer: int = 1):
    """Reference: the same DP as a Python loop over sub-layers and budgets, one state at a time.

    ``apply_single(kind, layer_x, h [*T, H])`` with ``kind`` 0 (Attention) or 1 (MLP);
    ``layers[k]`` the per-layer argument, ``targets[k][c]`` the reference state.
    Returns ``(DPTrace, {slot: final state})``.
    """
    n = len(layers)
    num_slots = budget + 1
    values = np.full((n, 2, num_slots), -np.inf)
    skipped = np.zeros((n, 2, num_slots), bool)
    valid = np.zeros((n, 2, num_slots), bool)
    denom = max(float(np.sum(np.asarray(token_mask, np.float32))), 1.0)
    g = {0: g0}
    for k in range(n):
        for col, w in ((0, w_attn), (1, w_mlp)):
            target = targets[k][col]
            new, best, came_from_skip = {}, {}, {}
            for j in sorted(g):  # execute (mandatory)
                state = apply_single(col, layers[k], g[j])
                value = float(cos_sum(state, target, token_mask))
                if value / denom >= tau and value > best.get(j, -np.inf):
                    new[j], best[j], came_from_skip[j] = state, value, False
            if sublayer_can_skip(can_skip, k, col):
                for j in sorted(g):  # skip
                    to = j + w
                    if to > budget:
                        continue
                    value = float(cos_sum(g[j], target, token_mask))
                    if value / denom >= tau and value > best.get(to, -np.inf):
                        new[to], best[to], came_from_skip[to] = g[j], value, True
            g = new
            for j in new:
                values[k, col, j] = best[j]
                skipped[k, col, j] = came_from_skip[j]
                valid[k, col, j] = True
    return DPTrace(values, skipped, valid, first_layer), g


Skips = Tuple[Tuple[int, int], ...]


def brute_force(apply_single: Callable, layers: Sequence[Any], g0, targets, can_skip, token_mask, *, w_attn: int,
                w_mlp: int, budget: int, tau: float = DEFAULT_TAU) -> Dict[int, Tuple[float, Skips]]:
    """Exhaustive search over every skip set of the skippable sub-layers (``can_skip``, per layer
    ``[n]`` or per sub-layer ``[n, 2]``), with the
    DP's constraints: a path is pruned as soon as its mean cosine at some depth is ``< tau``, and
    its skipped weight must stay ``<= budget``. Returns ``{weight: (best final value, skipped
    (layer index, column) pairs)}`` (first found wins ties; execution is explored first)."""
    n = len(layers)
    denom = max(float(np.sum(np.asarray(token_mask, np.float32))), 1.0)
    weights = (w_attn, w_mlp)
    best: Dict[int, Tuple[float, Skips]] = {}

    def visit(k, h, weight, skips, value):
        if k == 2 * n:
            if value > best.get(weight, (-np.inf,))[0]:
                best[weight] = (value, skips)
            return
        layer, col = divmod(k, 2)
        target = targets[layer][col]
        state = apply_single(col, layers[layer], h)
        v = float(cos_sum(state, target, token_mask))
        if v / denom >= tau:
            visit(k + 1, state, weight, skips, v)
        if sublayer_can_skip(can_skip, layer, col) and weight + weights[col] <= budget:
            v = float(cos_sum(h, target, token_mask))
            if v / denom >= tau:
                visit(k + 1, h, weight + weights[col], skips + ((layer, col),), v)

    if n == 0:
        return {0: (float(cos_sum(g0, g0, token_mask)), ())}
    visit(0, g0, 0, (), -np.inf)
    return best


def backtrack(trace: DPTrace, num_layers: int, w_attn: int, w_mlp: int) -> Tuple[np.ndarray, np.ndarray]:
    """Masks ``[C, L, 2]`` (True = skip) of the surviving final slots, and those slots ``[C]``."""
    weights = (w_attn, w_mlp)
    slots = np.nonzero(trace.final_valid)[0]
    masks = np.zeros((len(slots), num_layers, 2), bool)
    n = trace.values.shape[0]
    for c, slot in enumerate(slots):
        j = int(slot)
        for k in range(2 * n - 1, -1, -1):
            layer, col = divmod(k, 2)
            if not trace.valid[layer, col, j]:
                raise AssertionError(f"backtrack reached an empty slot (layer {layer}, column {col}, j={j})")
            if trace.skipped[layer, col, j]:
                masks[c, trace.first_layer + layer, col] = True
                j -= weights[col]
        if j != 0:
            raise AssertionError(f"backtrack of slot {slot} ended at weight {j}, not 0")
    return masks, slots
