"""KnapSpec knapsack DP over sub-layers (docs/methods.md §4.3, defaults of the official code).

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

Implementations (same semantics, same result):

* :func:`dp_scan` -- ``jax.lax.scan`` over layers (two sub-layer transitions per step),
  vectorised over all ``J = budget + 1`` slots: the sub-layer is applied to all ``J`` states
  as one batch. For the model (:func:`knapsack_dp`) the attention is *branch-parallel*: every
  branch's ``r`` query rows attend to the true full-model prefix KV cache of that layer
  (``prefix_len`` valid slots) plus the branch's own new K/V, causally -- exactly
  :func:`jaxspec.models.layers.attention_sublayer`, ``vmap``-ed over branches (the cache is shared,
  not copied); ``branch_chunk`` bounds memory with ``lax.map(batch_size=...)``. With
  ``history_backend`` (a kernel backend, e.g. ``"pallas"`` on a GPU) the branches are folded into the
  query rows instead: the backend's history kernel serves all ``J x r`` rows of a row's cache with an
  online softmax (one read of the cache per block of query rows), and each branch's own new K/V are
  merged in exactly
  (:func:`branch_folded_attention`); the vmap-ed reference materialises ``J x Hq x r x S`` float32
  scores per layer, several passes of which dominate the DP at long context.
  With ``reference_kv="target"`` (:data:`REFERENCE_KV`) a branch's row ``t`` attends instead to the
  target's K/V of rows ``< t`` and to its own only at ``t`` (:func:`target_kv_attention`; the
  target's K/V of a layer are projected once from its boundary state, for all branches).
* :func:`dp_unrolled` -- the same vectorised transitions traced once per layer on the model's own
  weights (no stacked copy, no per-iteration slice of the weights), each sub-layer on the slots it can
  reach: :func:`knapsack_dp` ``layers="unrolled"``.
* :func:`dp_loop` -- a plain Python loop over sub-layers and budgets, one candidate state at a
  time (the official algorithm's structure): the reference the scan is tested against.
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

from jaxspec.config import ModelConfig
from jaxspec.models.cache import KVCache
from jaxspec.models.attention import batchable_config, get_backend, grouped_key_scores
from jaxspec.models.layers import (attention_sublayer, decoder_layer, default_positions, embed, lm_head, mlp_sublayer,
                                   project_qkv, rope_tables)

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
@dataclasses.dataclass
class DPTrace:
    """Per scanned layer ``k`` (model layer ``first_layer + k``) and sub-layer ``c`` (0 attn, 1 mlp):
    ``values[k, c, j]`` (sum of cosines, ``-inf`` where the slot is empty), ``skipped[k, c, j]``
    (the slot's state came from the skip transition) and ``valid[k, c, j]``."""

    values: np.ndarray  # [n, 2, J] float
    skipped: np.ndarray  # [n, 2, J] bool
    valid: np.ndarray  # [n, 2, J] bool
    first_layer: int = 1

    @property
    def final_valid(self) -> np.ndarray:
        return self.valid[-1, 1]

    @property
    def final_values(self) -> np.ndarray:
        return self.values[-1, 1]


def _transition(g, valid, executed, target, token_mask, denom, *, w: int, skip_allowed, budget: int, tau: float):
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
        step = functools.partial(_transition, token_mask=token_mask, denom=denom, budget=slots - 1, tau=tau)

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
            g, valid, val, choice = _transition(pad(g, reach, g0), pad(valid, reach, False), executed, targets[k, c],
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


# ---------------------------------------------------------------------------- model plumbing
def check_reference_kv(reference_kv: str) -> str:
    if reference_kv not in REFERENCE_KV:
        raise ValueError(f"reference_kv={reference_kv!r}: choose from {', '.join(map(repr, REFERENCE_KV))}")
    return reference_kv


def target_kv_attention(config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, k_ref, v_ref):
    """Attention of ``T`` reference rows (``reference_kv="target"``): row ``t`` attends to the first
    ``lengths[b]`` cache slots, to the target's K/V ``k_ref, v_ref [B, T, Hkv, D]`` of rows ``< t``
    and to its own (the candidate's) ``k_new, v_new`` at ``t``. ``q [B, T, Hq, D]``; returns
    ``[B, T, Hq, D]`` (jnp, float32 softmax, the same GQA layout as the reference attention)."""
    batch, steps, num_heads, dim = q.shape
    groups = config.queries_per_kv
    scale = 1.0 / np.sqrt(dim)
    qg = q.reshape(batch, steps, config.num_kv_heads, groups, dim).transpose(0, 2, 3, 1, 4)  # [B,Hkv,G,T,D]
    valid = jnp.arange(cache_k.shape[2])[None, :] < lengths[:, None]  # [B, S]
    s_hist = grouped_key_scores(cache_k, qg) * scale
    s_hist = jnp.where(valid[:, None, None, None, :], s_hist, -jnp.inf)
    kr, vr = k_ref.transpose(0, 2, 1, 3), v_ref.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    kn, vn = k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3)
    s_ref = jnp.einsum("bkgtd,bkud->bkgtu", qg, kr, preferred_element_type=jnp.float32) * scale
    s_ref = jnp.where(jnp.tril(jnp.ones((steps, steps), bool), -1), s_ref, -jnp.inf)  # strictly earlier rows
    s_self = jnp.einsum("bkgtd,bktd->bkgt", qg, kn, preferred_element_type=jnp.float32)[..., None] * scale
    probs = jax.nn.softmax(jnp.concatenate([s_hist, s_ref, s_self], axis=-1), axis=-1)
    hist = cache_k.shape[2]
    p_hist, p_ref, p_self = probs[..., :hist], probs[..., hist:hist + steps], probs[..., hist + steps:]
    out = jnp.einsum("bkgts,bksd->bkgtd", p_hist.astype(q.dtype), cache_v, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgtu,bkud->bkgtd", p_ref.astype(q.dtype), vr, preferred_element_type=jnp.float32)
    out = out + p_self * vn[:, :, None].astype(jnp.float32)
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(batch, steps, num_heads, dim)


def _layer_arg(params, cache: KVCache, states, i: int, reference_kv: str):
    """Layer ``i``'s argument of the sub-layer functions (:func:`_model_sublayers`)."""
    return (params.layers[i], cache.keys[i], cache.values[i]) + ((states[2 * i],) if reference_kv == "target" else ())


def reference_attention_inputs(states, num_layers: int):
    """The target's input to the Attention sub-layer of each scanned layer ``1 .. L-1`` (boundary
    ``2l``) from :func:`boundary_states`: ``[L - 1, B, r, H]``."""
    return states[2:2 * num_layers - 1:2]


def _rope(config: ModelConfig, prefix_len, steps: int):
    return rope_tables(config, default_positions(prefix_len.astype(jnp.int32), steps))


def _residual_stream(params, tokens, cache: KVCache, prefix_len, *, config: ModelConfig, write: bool):
    """The target's residual stream ``[2L + 1, B, r, H]`` of ``tokens`` at positions ``prefix_len ..``, each layer
    the model's own :func:`~jaxspec.models.layers.decoder_layer` (attending to the first ``prefix_len[b]`` slots
    and the tokens themselves, causally); with ``write`` their K/V are written at those slots as a prefill chunk
    writes them. Returns ``(states, keys, values)``: the cache's buffers (unchanged without ``write``)."""
    cos, sin = _rope(config, prefix_len, tokens.shape[1])
    h = embed(params, tokens, config)
    states, keys, values = [h], list(cache.keys), list(cache.values)
    for i, layer in enumerate(params.layers):
        with jax.named_scope(f"layer{i}"):
            out = decoder_layer(layer, h, config, cos, sin, cache.keys[i], cache.values[i], prefix_len,
                                write_cache=write)
        states += [out.attention_hidden, out.hidden]
        h, keys[i], values[i] = out.hidden, out.cache_k, out.cache_v
    return jnp.stack(states), keys, values


def _boundary_states_fn(params, tokens, cache: KVCache, prefix_len, *, config: ModelConfig):
    return _residual_stream(params, tokens, cache, prefix_len, config=config, write=False)[0]


_boundary_states = jax.jit(_boundary_states_fn, static_argnames=("config",))


def boundary_states(params, config: ModelConfig, tokens, cache: KVCache, prefix_len) -> jax.Array:
    """The target's residual stream ``[2L + 1, B, r, H]`` for ``tokens [B, r]`` at positions
    ``prefix_len[b] + 0 .. r-1``, attending to the first ``prefix_len[b]`` cache slots of each row
    plus themselves (causally). Nothing is written to the cache."""
    return _boundary_states(params, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(prefix_len, jnp.int32),
                            config=_dp_config(config))


def _window_prefill_fn(params, tokens, cache: KVCache, prefix_len, counts, *, config: ModelConfig):
    """:func:`_boundary_states_fn` that also writes the tokens' K/V into ``cache`` (the prefill of a prompt's last
    tokens, docs/methods.md §5.6): the cache is the prefill's, and the residual stream between the sub-layers is
    kept. Padding tokens past a row's ``counts`` write beyond its new length, as a prefill's padding does."""
    states, keys, values = _residual_stream(params, tokens, cache, prefix_len, config=config, write=True)
    last = jnp.take_along_axis(states[-1], jnp.maximum(counts - 1, 0)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    new_cache = KVCache(keys=tuple(keys), values=tuple(values), lengths=prefix_len + counts, frozen=cache.frozen)
    return states, new_cache, lm_head(params, last, config)


_window_prefill = jax.jit(_window_prefill_fn, static_argnames=("config",), donate_argnames=("cache",))


def window_prefill(params, config: ModelConfig, tokens, cache: KVCache, prefix_len, counts):
    """Prefill ``tokens [B, r]`` (row ``b``'s first ``counts[b]`` valid, right-padded) at slots
    ``prefix_len[b] ..`` of ``cache`` (donated) and keep their residual stream. Returns
    ``(states [2L + 1, B, r, H], cache with lengths prefix_len + counts, logits [B, V] at each row's
    last valid token)``. ``states`` equal :func:`boundary_states` of the same tokens before the write."""
    return _window_prefill(params, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(prefix_len, jnp.int32),
                           jnp.asarray(counts, jnp.int32), config=config)


def _dp_config(config: ModelConfig) -> ModelConfig:
    # the DP vmaps attention over branches: a backend that cannot run batched falls back to the
    # reference attention
    return batchable_config(config)


def _head_argmax(params, config: ModelConfig, states):
    return jnp.argmax(lm_head(params, states, config), axis=-1)


#: reference rows (candidates x batch rows x tokens) scored per pass of the LM head when the candidates per pass are
#: not given: the head's weights are read once per pass, so passes of a few rows each (8 candidates of a two-stage
#: plan's 2 search tokens: 16 rows) re-read the whole head ~9 times per DP, a large share of the DP of
#: Qwen2.5-Coder-1.5B on a 2-core CPU; 512 rows of float32 logits of a 152k vocabulary are ~0.3 GB
AGREEMENT_ROWS = 512


def agreement_chunk(final_states, chunk: Optional[int] = None) -> int:
    """Candidates per LM-head pass of :func:`_agreement` for ``final_states [C, B, r, H]``: ``chunk`` when given,
    else as many as fill :data:`AGREEMENT_ROWS` rows (at least 1, at most ``C``)."""
    if chunk is not None:
        if isinstance(chunk, bool) or int(chunk) < 1:
            raise ValueError(f"alpha_chunk={chunk!r} must be a positive number of candidates per pass (or None)")
        return int(chunk)
    rows = max(int(np.prod(final_states.shape[1:-1])), 1)
    return int(min(max(AGREEMENT_ROWS // rows, 1), max(final_states.shape[0], 1)))


def _agreement(params, config, final_states, teacher_state, token_mask, chunk: Optional[int],
               threshold: Optional[float]):
    """Per candidate, over the masked reference tokens: ``[J, 3]`` = (alpha: greedy agreement with
    the target; p_c: share of tokens whose greedy probability is >= ``threshold``, i.e. where the
    draft would not exit early; p_ac: share both agreeing and confident). ``threshold`` None: no
    early exit (p_c = 1, p_ac = alpha). ``chunk``: candidates per pass of the LM head (None:
    :func:`agreement_chunk`)."""
    teacher = jnp.argmax(lm_head(params, teacher_state, config), -1)
    mask = jnp.asarray(token_mask, jnp.float32)
    denom = jnp.maximum(jnp.sum(mask), 1.0)

    def one(state):
        logits = lm_head(params, state, config)
        agree = (jnp.argmax(logits, -1) == teacher).astype(jnp.float32) * mask
        if threshold is None:
            confident = mask
        else:  # greedy probability = exp(max logit - logsumexp)
            top = jnp.max(logits, -1)
            confident = (jnp.exp(top - jax.nn.logsumexp(logits, -1)) >= threshold).astype(jnp.float32) * mask
        return jnp.stack([jnp.sum(agree), jnp.sum(confident), jnp.sum(agree * confident)]) / denom

    return jax.lax.map(one, final_states, batch_size=agreement_chunk(final_states, chunk))


# compiled once per shape: run eagerly, the map over candidates re-traced and dispatched op by op on
# every call (~0.13 s per rescore of SmolLM2 on a 2-core CPU, whatever the window's width)
_agreement_jit = jax.jit(_agreement, static_argnums=(1, 5, 6))


def _alpha(params, config, final_states, teacher_state, token_mask, chunk: Optional[int] = None):
    """Greedy agreement of each candidate's final state with the target's, over the masked tokens."""
    return _agreement(params, config, final_states, teacher_state, token_mask, chunk, None)[:, 0]


def branch_folded_attention(config: ModelConfig, backend: str, q, k_new, v_new, cache_k, cache_v, lengths,
                            max_rows: Optional[int] = None):
    """The DP's branch-parallel attention with the branches folded into the query rows: ``q [J, B, r, Hq, D]``
    and each branch's own ``k_new, v_new [J, B, r, Hkv, D]``; every branch's rows attend to the first
    ``lengths[b]`` slots of the shared ``cache_k/v [B, Hkv, S, D]`` and causally to their own branch's new
    K/V. Returns ``[J, B, r, Hq, D]``, what :func:`jaxspec.models.layers.attention_sublayer`'s attention
    gives per branch. The history part is ``backend``'s history kernel over all ``J x r`` rows (no scores
    written; the cache read once per block of query rows), merged with each branch's new-token part by
    their softmax statistics (docs/methods.md §4.3). ``max_rows``: query rows per kernel call (a power of
    two >= 16; default the kernel's ``MAX_QUERY_ROWS``), each call one read of the cache."""
    from pallas_kernels import attention as kernels
    from pallas_kernels import reference

    branches, batch, steps, num_heads, dim = q.shape
    kv_heads, groups = config.num_kv_heads, config.queries_per_kv
    rows = branches * steps  # per KV group: row j * r + t
    folded = q.transpose(1, 0, 2, 3, 4).reshape(batch, rows, num_heads, dim)
    packed = kernels.pack_queries(folded, kv_heads, 1.0 / np.sqrt(dim))  # [B, Hkv, >= G * J * r, D]
    used = groups * rows
    chosen = get_backend(backend)
    if max_rows is None:
        partials = chosen.dense_history_partials(packed, cache_k, cache_v, lengths)
    else:
        partials = kernels.dense_history_partials(packed, cache_k, cache_v, lengths, interpret=chosen.interpret,
                                                  max_rows=int(max_rows))
    history = kernels.merged_history(partials, used)
    qg = packed[:, :, :used].reshape(batch, kv_heads, groups, branches, steps, dim)
    kn = k_new.transpose(1, 3, 0, 2, 4)  # [B, Hkv, J, r, D]
    vn = v_new.transpose(1, 3, 0, 2, 4)
    scores = jnp.einsum("bkgjtd,bkjud->bkjgtu", qg, kn, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((steps, steps), bool))
    acc, l, m = reference.partial_from_scores(scores, causal, vn[:, :, :, None])  # [B, Hkv, J, G, r, (D)]
    new_part = (acc.transpose(0, 1, 3, 2, 4, 5).reshape(batch, kv_heads, used, dim),
                l.transpose(0, 1, 3, 2, 4).reshape(batch, kv_heads, used),
                m.transpose(0, 1, 3, 2, 4).reshape(batch, kv_heads, used))
    out = reference.normalize(reference.merge_partials([history, new_part]), q.dtype)  # [B, Hkv, G*J*r, D]
    out = out.reshape(batch, kv_heads, groups, branches, steps, dim)
    return out.transpose(3, 0, 4, 1, 2, 5).reshape(branches, batch, steps, num_heads, dim)


def check_history_backend(history_backend: Optional[str], reference_kv: str = "branch",
                          branch_chunk: Optional[int] = None) -> Optional[str]:
    """``history_backend`` of :func:`knapsack_dp` checked: None for the reference attention (None or
    ``"xla"``), else the name of a backend with a history kernel that runs on this platform."""
    if history_backend is None or history_backend == "xla":
        return None
    backend = get_backend(history_backend)  # raises on an unknown name, listing the valid ones
    if not backend.opaque_kernel or backend.tpu_kernels:
        raise ValueError(f"history_backend={history_backend!r}: the DP folds its branches into a Triton history "
                         f"kernel; valid: 'pallas' (GPU), 'pallas-interpret' (any platform, slow), 'xla' or None "
                         f"(the reference attention)")
    if not backend.runs_on():
        raise ValueError(f"history_backend={history_backend!r} needs a GPU ({backend.description}); this platform "
                         f"is {jax.default_backend()!r}: valid here 'pallas-interpret' (slow) or 'xla' / None")
    if reference_kv != "branch":
        raise ValueError(f"history_backend={history_backend!r} folds the 'branch' reference's attention; "
                         f"reference_kv={reference_kv!r} runs the reference attention (leave history_backend None)")
    if branch_chunk:
        raise ValueError(f"history_backend={history_backend!r} runs every branch in one kernel call; "
                         f"branch_chunk={branch_chunk} (branches per batch) is for the reference attention")
    return history_backend


def _model_sublayers(config: ModelConfig, prefix_len, steps: int, branch_chunk: Optional[int],
                     reference_kv: str = "branch", history_backend: Optional[str] = None,
                     history_rows: Optional[int] = None):
    """Sub-layer functions of the model for the DP: single state and all-slots versions. A layer's
    argument is ``(layer, cache_k, cache_v)``, with ``reference_kv="target"`` also the target's input
    to its Attention sub-layer ``[B, r, H]`` (:func:`reference_attention_inputs`). ``history_backend``:
    the all-slots Attention folds the branches into one history-kernel call of that backend
    (:func:`branch_folded_attention`; the "branch" reference only)."""
    cos, sin = _rope(config, prefix_len, steps)
    check_reference_kv(reference_kv)

    def reference_kv_of(layer_x):  # the target's K/V of the reference tokens at this layer
        _, k, v = project_qkv(layer_x[0], layer_x[3], config, cos, sin)
        return k, v

    def attn(layer_x, h, ref_kv=None):
        layer, cache_k, cache_v = layer_x[:3]
        if reference_kv == "target":
            k_ref, v_ref = reference_kv_of(layer_x) if ref_kv is None else ref_kv
            attend = functools.partial(target_kv_attention, config, cache_k=cache_k, cache_v=cache_v,
                                       lengths=prefix_len, k_ref=k_ref, v_ref=v_ref)
        else:
            attend = None
        return attention_sublayer(layer, h, config, cos, sin, cache_k, cache_v, prefix_len, attend=attend).hidden

    def mlp(layer_x, h):
        return mlp_sublayer(layer_x[0], h, config)

    def attn_all(layer_x, g):  # branch-parallel: every branch attends to the shared prefix cache
        if history_backend is not None and reference_kv == "branch":
            layer, cache_k, cache_v = layer_x[:3]
            q, k, v = jax.vmap(lambda h: project_qkv(layer, h, config, cos, sin))(g)
            out = branch_folded_attention(config, history_backend, q, k, v, cache_k, cache_v, prefix_len,
                                          history_rows)
            return g + jnp.einsum("jbtq,qd->jbtd", out.reshape(g.shape[:3] + (-1,)), layer.wo)
        ref_kv = reference_kv_of(layer_x) if reference_kv == "target" else None  # once for all branches
        fn = functools.partial(attn, layer_x, ref_kv=ref_kv)
        if branch_chunk:
            return jax.lax.map(fn, g, batch_size=branch_chunk)
        return jax.vmap(fn)(g)

    def mlp_all(layer_x, g):
        return mlp(layer_x, g.reshape((-1,) + g.shape[2:])).reshape(g.shape)

    return attn, mlp, attn_all, mlp_all


_stack_layers = jax.jit(lambda layers: jax.tree.map(lambda *xs: jnp.stack(xs), *layers))
_STACKED: list = []  # [(params.layers tuple, its layers 1.. stacked)], newest last


def stacked_scan_layers(params, reuse: bool = True):
    """Layers ``1 .. L-1`` of ``params`` stacked along a leading axis (the scan's ``xs``).

    With ``reuse`` the stacked copy is kept for the same ``params.layers`` tuple object (the
    two most recent), so a re-plan does not copy every weight again (~0.4 GB for SmolLM2 in
    float32, ~0.1-0.2 s on a 2-core CPU per plan); the price is one extra copy of the layer
    weights in memory. A new or modified parameter tree (another tuple object) is stacked anew."""
    layers = params.layers
    if reuse:
        for held, stacked in _STACKED:
            if held is layers:
                return stacked
    stacked = _stack_layers(layers[1:])
    if reuse:
        _STACKED.append((layers, stacked))
        del _STACKED[:-2]
    return stacked


def _knapsack_dp_fn(params, stacked, cache: KVCache, prefix_len, states, token_mask, *, config, w_attn, w_mlp,
                    budget, tau, branch_chunk, alpha_chunk, exit_threshold=None, keep_attention=(),
                    reference_kv="branch", history_backend=None, history_rows=None, segments=None,
                    layers="scan"):
    """``layers="scan"``: :func:`dp_scan` over ``stacked`` (layers 1.. stacked) and a stacked copy of the cache;
    ``"unrolled"``: :func:`dp_unrolled` over ``params.layers`` and the cache's own arrays (``stacked`` unused)."""
    num_layers = config.num_layers
    _, _, attn_all, mlp_all = _model_sublayers(config, prefix_len, states.shape[2], branch_chunk, reference_kv,
                                               history_backend, history_rows)
    targets = states[3:].reshape((num_layers - 1, 2) + states.shape[1:])
    can = scan_can_skip(num_layers, keep_attention)
    refs = reference_attention_inputs(states, num_layers) if reference_kv == "target" else None
    if layers == "unrolled":
        def block_padded(x):  # the kernel walks the cache in blocks: pad where the capacity is off its block
            extra = get_backend(history_backend).round_capacity(x.shape[2]) - x.shape[2]
            return x if extra == 0 else jnp.pad(x, ((0, 0),) * 2 + ((0, extra), (0, 0)))

        fix = block_padded if history_backend is not None else (lambda x: x)
        args = [(params.layers[i], fix(cache.keys[i]), fix(cache.values[i])) + (() if refs is None else (refs[i - 1],))
                for i in range(1, num_layers)]
        values, skipped, valid, final = dp_unrolled(attn_all, mlp_all, args, states[2], targets, can, token_mask,
                                                    w_attn=w_attn, w_mlp=w_mlp, budget=budget, tau=tau)
    else:
        keys, values = jnp.stack(cache.keys[1:]), jnp.stack(cache.values[1:])
        if history_backend is not None:  # the kernel walks the cache in blocks: pad the stacked copy (slots unread)
            pad = get_backend(history_backend).round_capacity(keys.shape[3]) - keys.shape[3]
            keys, values = (jnp.pad(x, ((0, 0),) * 3 + ((0, pad), (0, 0))) for x in (keys, values))
        layer_xs = (stacked, keys, values) + (() if refs is None else (refs,))
        values, skipped, valid, final = dp_scan(attn_all, mlp_all, layer_xs, states[2], targets, jnp.asarray(can),
                                                token_mask, w_attn=w_attn, w_mlp=w_mlp, budget=budget, tau=tau,
                                                segments=segments)
    stats = _agreement(params, config, final, states[-1], token_mask, alpha_chunk, exit_threshold)
    return values, skipped, valid, stats, final


_knapsack_dp = jax.jit(_knapsack_dp_fn, static_argnames=("config", "w_attn", "w_mlp", "budget", "tau",
                                                          "branch_chunk", "alpha_chunk", "exit_threshold",
                                                          "keep_attention", "reference_kv", "history_backend",
                                                          "history_rows", "segments", "layers"))


@dataclasses.dataclass
class Candidates:
    """The DP's output: one candidate skip set per surviving final slot (ascending skipped weight)."""

    masks: np.ndarray  # [C, L, 2] bool, True = skip (column 0 Attention, column 1 MLP)
    weights: np.ndarray  # [C] skipped weight j of each candidate
    cosine: np.ndarray  # [C] mean cosine with the target's final state
    alpha: np.ndarray  # [C] greedy-token agreement with the target on the reference tokens
    w_attn: int
    w_mlp: int
    budget: int
    trace: Optional[DPTrace] = None
    final_states: Any = None  # [C, B, r, H] (kept only when asked)
    # early-exit statistics (knapsack_dp(exit_threshold=...)): share of reference tokens where the
    # candidate's greedy probability reaches the threshold, and where it also agrees with the target
    confident: Optional[np.ndarray] = None  # [C] p_c
    agree_confident: Optional[np.ndarray] = None  # [C] p_ac
    # a two-stage plan (jaxspec.knapspec.skip_planner.rescore_finalists): alpha on the search tokens the DP ran on,
    # and their number per row; alpha / confident / agree_confident are then the whole window's
    search_alpha: Optional[np.ndarray] = None  # [C]
    search_tokens: Optional[int] = None
    # how the finalists were scored on the window: "executed" (conditionals) or "select" (policy.KnapSpecConfig.rescore)
    rescore: Optional[str] = None
    # the backend the DP's branch attention folded into (knapsack_dp's history_backend; None: the reference)
    history_backend: Optional[str] = None
    # wall seconds of each part of the plan that produced these candidates (policy.plan_skip_set:
    # boundary_states, dp, grid_search, rescore), None when not recorded
    stage_seconds: Optional[Dict[str, float]] = None

    def __len__(self) -> int:
        return len(self.weights)


def _trivial_candidates(params, config, states, token_mask, w_attn, w_mlp, budget) -> Candidates:
    return Candidates(masks=np.zeros((1, config.num_layers, 2), bool), weights=np.zeros(1, int),
                      cosine=np.ones(1), alpha=np.ones(1), w_attn=w_attn, w_mlp=w_mlp, budget=budget)


def knapsack_dp(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *, w_attn: int,
                w_mlp: int, budget: Optional[int] = None, tau: float = DEFAULT_TAU, branch_chunk: Optional[int] = None,
                alpha_chunk: Optional[int] = None, keep_states: bool = False, reuse_stacked: bool = True,
                exit_threshold: Optional[float] = None, keep_attention: Sequence[int] = (),
                reference_kv: str = "branch", history_backend: Optional[str] = None,
                history_rows: Optional[int] = None, segments: int = DEFAULT_SEGMENTS,
                layers: str = "scan") -> Candidates:
    """Run the jit-compiled, scan-vectorised DP on the model.

    ``reuse_stacked``: keep the stacked layer weights between calls (:func:`stacked_scan_layers`).

    ``cache``: the target cache whose first ``prefix_len[b]`` slots of row ``b`` hold the
    full-model K/V of the prefix (later slots are ignored); ``states [2L+1, B, r, H]`` from
    :func:`boundary_states` for the reference tokens at positions ``prefix_len + 0..r-1``;
    ``token_mask [B, r]`` (default all ones) marks real reference tokens (padding = 0).
    ``exit_threshold``: also return each candidate's early-exit statistics at this draft
    confidence (``Candidates.confident`` / ``agree_confident``; for the exit-aware TPT).
    ``keep_attention``: layers whose Attention sub-layer no candidate skips (module doc).
    ``reference_kv``: how the reference tokens see one another (:data:`REFERENCE_KV`).
    ``history_backend``: an attention backend with a history kernel (``"pallas"`` on a GPU,
    ``"pallas-interpret"`` anywhere, for tests) that the branch-parallel Attention folds all branches
    into (:func:`branch_folded_attention`); None or ``"xla"``: the ``vmap``-ed reference attention.
    ``history_rows``: with ``history_backend``, query rows per kernel call (a power of two >= 16; default
    the kernel's); each call reads the cache once.
    ``segments``: the scan in at most this many runs of layers, each over the slots it can reach
    (:func:`slot_segments`; the same result, fewer slot-layers computed, one compiled body per run); 1 = one
    scan of every slot.
    ``alpha_chunk``: candidates per pass of the LM head that scores them (None: :data:`AGREEMENT_ROWS` rows a pass).
    ``layers``: :data:`DP_LAYERS` -- ``"scan"`` (:func:`dp_scan` over the stacked layers, in ``segments`` runs) or
    ``"unrolled"`` (:func:`dp_unrolled`: one traced step per layer on the model's own weights, each sub-layer on
    the slots it can reach; no stacked copy, ``segments`` unused). The same candidates either way.
    """
    if layers not in DP_LAYERS:
        raise ValueError(f"layers={layers!r}; valid: {', '.join(DP_LAYERS)}")
    config = _dp_config(config)
    keep_attention = check_keep_attention(keep_attention, config.num_layers)
    check_reference_kv(reference_kv)
    history_backend = check_history_backend(history_backend, reference_kv, branch_chunk)
    if history_rows is not None:
        if history_backend is None:
            raise ValueError(f"history_rows={history_rows} sets the kernel's rows per call: it needs a "
                             f"history_backend (the reference attention has no kernel)")
        if isinstance(history_rows, bool) or int(history_rows) < 16 or int(history_rows) & (int(history_rows) - 1):
            raise ValueError(f"history_rows={history_rows} must be a power of two >= 16")
    budget = skip_budget(w_attn, w_mlp, config.num_layers) if budget is None else int(budget)
    if isinstance(segments, bool) or int(segments) < 1:
        raise ValueError(f"segments={segments!r} must be an integer >= 1 (1: one scan of every slot)")
    if alpha_chunk is not None:
        agreement_chunk(states, alpha_chunk)  # a bad value fails here, before anything is compiled
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    if config.num_layers < 2:
        return _trivial_candidates(params, config, states, token_mask, w_attn, w_mlp, budget)
    outer = params.replace(layers=())  # the scan gets the layers stacked
    values, skipped, valid, stats, final = _knapsack_dp(
        params if layers == "unrolled" else outer,
        None if layers == "unrolled" else stacked_scan_layers(params, reuse_stacked), cache,
        jnp.asarray(prefix_len, jnp.int32), states,
        token_mask, config=config, w_attn=int(w_attn), w_mlp=int(w_mlp), budget=budget, tau=float(tau),
        branch_chunk=branch_chunk, alpha_chunk=alpha_chunk,
        exit_threshold=None if exit_threshold is None else float(exit_threshold), keep_attention=keep_attention,
        reference_kv=reference_kv, history_backend=history_backend,
        history_rows=None if history_rows is None else int(history_rows),
        segments=None if layers == "unrolled" else slot_segments(scan_can_skip(config.num_layers, keep_attention),
                                                                 int(w_attn), int(w_mlp), budget, int(segments)),
        layers=layers)
    trace = DPTrace(np.asarray(values, np.float64), np.asarray(skipped), np.asarray(valid), first_layer=1)
    masks, slots = backtrack(trace, config.num_layers, w_attn, w_mlp)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    stats = np.asarray(stats, np.float64)[slots]
    exits = exit_threshold is not None
    return Candidates(masks=masks, weights=slots, cosine=trace.final_values[slots] / denom,
                      alpha=stats[:, 0], w_attn=int(w_attn), w_mlp=int(w_mlp), budget=budget,
                      trace=trace, final_states=np.asarray(final)[slots] if keep_states else None,
                      confident=stats[:, 1] if exits else None, agree_confident=stats[:, 2] if exits else None,
                      history_backend=history_backend)


# ---------------------------------------------------------------------------- fixed plans
def _plan_states_fn(params, cache: KVCache, prefix_len, states, masks, *, config, reference_kv, executed_only=True):
    """Each mask's final state on the reference tokens. ``executed_only``: a sub-layer runs only where
    the mask executes it after an earlier skip (``lax.cond``): a skipped one passes its input on, and
    one before the mask's first skip sees the target's own input, so its output is the target's
    boundary state, read from ``states``. The cost is the executed sub-layers after the first skip,
    not the whole model, but a GPU reads each conditional's predicate on the host (2L round trips per
    mask). ``False``: every sub-layer of every mask runs, all masks in one ``vmap``, and a select keeps
    or drops it: more arithmetic, no control flow (the reference, and
    :attr:`~jaxspec.knapspec.config.KnapSpecConfig.rescore` ``"select"``)."""
    attn, mlp, _, _ = _model_sublayers(config, prefix_len, states.shape[2], None, reference_kv)

    def one(mask):
        h = states[0]
        diverged = jnp.asarray(False)
        for i in range(config.num_layers):
            x = _layer_arg(params, cache, states, i, reference_kv)
            for col, fn in ((0, attn), (1, mlp)):
                skip = mask[i, col]
                if not executed_only:
                    h = jnp.where(skip, h, fn(x, h))
                    continue
                target = states[2 * i + 1 + col]
                run = jnp.logical_and(diverged, jnp.logical_not(skip))
                h = jax.lax.cond(run, lambda x=x, h=h, fn=fn: fn(x, h),
                                 lambda h=h, skip=skip, target=target: jnp.where(skip, h, target))
                diverged = jnp.logical_or(diverged, skip)
        return h

    # with executed_only the conditionals need one mask at a time; the select form has no control flow, so every
    # mask runs in one batched pass (the weights read once for all of them)
    return jax.lax.map(one, masks) if executed_only else jax.vmap(one)(masks)


_plan_states = jax.jit(_plan_states_fn, static_argnames=("config", "reference_kv", "executed_only"))


def plan_alpha(params, config: ModelConfig, cache: KVCache, prefix_len, states, masks, token_mask=None, *,
               reference_kv: str = "branch") -> np.ndarray:
    """The DP's acceptance estimate for given skip masks ``[C, L, 2]`` (True = skip): each mask's
    greedy-token agreement with the target on the reference tokens of ``states``
    (:func:`boundary_states`), with the reference ``reference_kv`` (:data:`REFERENCE_KV`) -- the
    ``alpha`` :func:`knapsack_dp` reports for the masks it finds, for any mask."""
    return plan_agreement(params, config, cache, prefix_len, states, masks, token_mask, reference_kv=reference_kv)[:, 0]


def plan_agreement(params, config: ModelConfig, cache: KVCache, prefix_len, states, masks, token_mask=None, *,
                   reference_kv: str = "branch", exit_threshold: Optional[float] = None,
                   executed_only: bool = True) -> np.ndarray:
    """``[C, 3]`` per skip mask: (alpha, p_c, p_ac) on the reference tokens of ``states``, the statistics
    :func:`knapsack_dp` reports for its candidates (``exit_threshold`` None: p_c = 1, p_ac = alpha).
    ``executed_only``: run only each mask's executed sub-layers after its first skip (the default);
    ``False`` runs every sub-layer of every mask (the reference; same result)."""
    config = _dp_config(config)
    check_reference_kv(reference_kv)
    masks = np.asarray(masks, bool)
    if masks.ndim != 3 or masks.shape[1:] != (config.num_layers, 2):
        raise ValueError(f"masks of shape {masks.shape}: expected [C, {config.num_layers}, 2]")
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    finals = _plan_states(params, cache, jnp.asarray(prefix_len, jnp.int32), states, jnp.asarray(masks),
                          config=config, reference_kv=reference_kv, executed_only=executed_only)
    threshold = None if exit_threshold is None else float(exit_threshold)
    return np.asarray(_agreement_jit(params, config, finals, states[-1], token_mask, None, threshold), np.float64)


# ---------------------------------------------------------------------------- references on the model
@functools.partial(jax.jit, static_argnames=("config", "kind", "reference_kv"))
def _apply_single_jit(layer_x, h, prefix_len, *, config, kind, reference_kv="branch"):
    attn, mlp, _, _ = _model_sublayers(config, prefix_len, h.shape[1], None, reference_kv)
    return attn(layer_x, h) if kind == 0 else mlp(layer_x, h)


def _model_problem(params, config, cache, prefix_len, states, keep_attention=(), reference_kv="branch"):
    """Arguments of the generic :func:`dp_loop` / :func:`brute_force` for the model."""
    prefix_len = jnp.asarray(prefix_len, jnp.int32)
    check_reference_kv(reference_kv)
    layers = [_layer_arg(params, cache, states, i, reference_kv) for i in range(1, config.num_layers)]
    targets = [(states[2 * i + 1], states[2 * i + 2]) for i in range(1, config.num_layers)]
    can_skip = scan_can_skip(config.num_layers, check_keep_attention(keep_attention, config.num_layers))

    def apply_single(kind, layer_x, h):
        return _apply_single_jit(layer_x, h, prefix_len, config=config, kind=kind, reference_kv=reference_kv)

    return apply_single, layers, targets, can_skip


def knapsack_dp_reference(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *,
                          w_attn: int, w_mlp: int, budget: Optional[int] = None,
                          tau: float = DEFAULT_TAU, keep_attention: Sequence[int] = (),
                          reference_kv: str = "branch") -> Candidates:
    """The same DP with the Python loop of :func:`dp_loop` (unbatched ``attention_sublayer`` per
    candidate): the reference for :func:`knapsack_dp`."""
    config = _dp_config(config)
    budget = skip_budget(w_attn, w_mlp, config.num_layers) if budget is None else int(budget)
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    if config.num_layers < 2:
        return _trivial_candidates(params, config, states, token_mask, w_attn, w_mlp, budget)
    apply_single, layers, targets, can_skip = _model_problem(params, config, cache, prefix_len, states,
                                                             keep_attention, reference_kv)
    trace, final = dp_loop(apply_single, layers, states[2], targets, can_skip, token_mask, w_attn=w_attn,
                           w_mlp=w_mlp, budget=budget, tau=tau)
    masks, slots = backtrack(trace, config.num_layers, w_attn, w_mlp)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    teacher = _head_argmax(params, config, states[-1])
    alpha = [float(jnp.sum((_head_argmax(params, config, final[int(j)]) == teacher) * token_mask)) / denom
             for j in slots]
    return Candidates(masks=masks, weights=slots, cosine=trace.final_values[slots] / denom,
                      alpha=np.asarray(alpha), w_attn=int(w_attn), w_mlp=int(w_mlp), budget=budget, trace=trace,
                      final_states=np.stack([np.asarray(final[int(j)]) for j in slots]))


def knapsack_brute_force(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *,
                         w_attn: int, w_mlp: int, budget: Optional[int] = None, tau: float = DEFAULT_TAU,
                         keep_attention: Sequence[int] = (), reference_kv: str = "branch"
                         ) -> Dict[int, Tuple[float, np.ndarray]]:
    """Exhaustive search on the model (tiny models only: ``4^(L-2)`` skip sets):
    ``{skipped weight: (best mean final cosine, [L, 2] mask)}``."""
    config = _dp_config(config)
    budget = skip_budget(w_attn, w_mlp, config.num_layers) if budget is None else int(budget)
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    apply_single, layers, targets, can_skip = _model_problem(params, config, cache, prefix_len, states,
                                                             keep_attention, reference_kv)
    found = brute_force(apply_single, layers, states[2], targets, can_skip, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                        budget=budget, tau=tau)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    out = {}
    for weight, (value, skips) in found.items():
        mask = np.zeros((config.num_layers, 2), bool)
        for layer, col in skips:
            mask[1 + layer, col] = True
        out[weight] = (value / denom, mask)
    return out


def knapsack_exhaustive_count(num_layers: int) -> int:
    """Skip sets brute force enumerates (edge layers fixed): ``4^(L-2)``."""
    return 4 ** max(num_layers - 2, 0)



# public names of the DP's building blocks, for the coupled (whole-layer) DP of jaxspec.knapspec.coupled
dp_config = _dp_config
transition = _transition
agreement_alpha = _alpha
model_sublayers = _model_sublayers
trivial_candidates = _trivial_candidates
model_problem = _model_problem


__all__ = ["DEFAULT_TAU", "REFERENCE_KV", "WEIGHT_CAP", "Candidates", "check_reference_kv", "target_kv_attention",
           "reference_attention_inputs", "plan_alpha", "plan_agreement", "DPTrace", "backtrack", "boundary_states", "window_prefill", "brute_force",
           "check_keep_attention", "scan_can_skip", "sublayer_can_skip",
           "cos_sum", "dp_loop", "dp_scan", "knapsack_brute_force", "knapsack_dp", "knapsack_dp_reference",
           "knapsack_weights", "skip_budget", "knapsack_exhaustive_count", "stacked_scan_layers", "agreement_alpha",
           "agreement_chunk", "AGREEMENT_ROWS", "dp_unrolled", "DP_LAYERS",
           "dp_config", "model_problem", "model_sublayers", "transition", "trivial_candidates"]
