"""Selection of ``I_verify`` (docs/methods.md §3.2): sinks + window, top-m by ``s_D``, the rest by ``s_T``.

One set of ``k`` history positions per sequence, shared by every layer and KV head:

1. the first ``s`` positions (sinks) and the last ``w`` history positions (window);
2. the top ``m`` positions by the draft signal ``s_D`` among the rest;
3. the top ``k - s - w - m`` by the target signal ``s_T`` among what is still left.

The signals are only ranked, never added. Ties are broken by the lower position (the exact
top-k of :func:`select_top_k`). Padding (positions ``>= length``) is
never chosen; a row whose history has at most ``k`` positions gets all of them (dense). The
output ``[B, k]`` int32 is sorted by position with ``-1`` after the chosen positions (only when
the history is shorter than ``k``); the forward ignores ``-1`` entries.

Built on two radix selections: (i) ``select_top_k(s_D, k=s+w+m)`` gives the protected set plus
the top-m by ``s_D``; (ii) ``select_top_k`` of ``s_T`` with those m positions lifted to ``+inf``
keeps them and fills the remaining budget by ``s_T``.

The radix select itself (:func:`select_top_k`): ``lax.top_k`` over 32k positions for 64 rows
took ~0.4 ms on the H200 -- more than the sparse attention it feeds. Here the top-r is found by
**radix select** on order-preserving 32-bit keys: four passes, each a 256-bin histogram
(scatter-add) of one byte among the surviving candidates (on a GPU from 32k positions: eight passes of a
16-bin compare histogram, :func:`default_radix`), find the exact r-th largest key; the
selection is then ``key > threshold`` plus the first ``need`` positions with ``key ==
threshold`` (ties broken deterministically by lower position), compacted with a cumulative sum.
Every step is O(S) and elementwise or a scatter: no sort. The output is sorted by position,
which also makes the gather kernel's reads more local. Protected positions (attention sinks
``[0, sinks)`` and the window ``[length - window, length)``) are always kept and take part of
the budget.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxspec.dustin.config import DustinConfig
from pallas_kernels.selection import radix_threshold_pallas


# ---------------------------------------------------------------------------- exact top-k by radix select
def order_preserving_keys(scores: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (larger float, larger key; -0.0 and +0.0 tie)."""
    scores = scores.astype(jnp.float32)
    scores = jnp.where(scores == 0, jnp.float32(0), scores)  # -0.0 -> +0.0
    bits = jax.lax.bitcast_convert_type(scores, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def histogram_counts(digit: jax.Array, alive: jax.Array, bins: int, method: str) -> jax.Array:
    """Per-row counts ``[B, bins]`` of ``digit [B, S]`` among the ``alive`` positions."""
    if method == "scatter":  # atomics into bins (contended on GPU)
        rows = jnp.arange(digit.shape[0])[:, None]
        return jnp.zeros((digit.shape[0], bins), jnp.int32).at[rows, digit].add(alive.astype(jnp.int32))
    if method == "compare":  # one fused compare-and-reduce, no atomics
        hit = (digit[:, :, None] == jnp.arange(bins, dtype=digit.dtype)[None, None, :]) & alive[:, :, None]
        return jnp.sum(hit.astype(jnp.int32), axis=1)
    raise ValueError(f"histogram method {method!r}: expected 'scatter' or 'compare'")


#: on a GPU, rows of at least this many positions count each radix pass with a 4-bit compare histogram instead of
#: an 8-bit scatter-add: at 32k positions the H200 measured 81-120 us against 104-191 us a top-k at batch 1-16 on
#: both layer shapes (scatter-add atomics contend), while at 8k-16k the two traded places (docs/kernels.md)
COMPARE_RADIX_FROM = 32768


def default_radix(positions: int) -> Tuple[int, str]:
    """The radix digit width and histogram :func:`select_top_k` uses for rows of ``positions`` when none is given:
    ``(4, "compare")`` on a GPU from :data:`COMPARE_RADIX_FROM` positions, else ``(8, "scatter")``. Every
    choice gives the same set; only the cost differs."""
    if jax.default_backend() == "gpu" and positions >= COMPARE_RADIX_FROM:
        return 4, "compare"
    return 8, "scatter"


def radix_threshold(keys: jax.Array, candidate: jax.Array, need: jax.Array, *, bits: Optional[int] = None,
                     histogram: Optional[str] = None):
    """Exact ``need``-th largest key among ``candidate`` positions of each row.

    ``keys [B, S]`` uint32, ``candidate [B, S]`` bool, ``need [B]`` int32 (>= 1, <= #candidates).
    ``32 / bits`` passes, each a histogram of one ``bits``-wide digit among the keys that still
    share the chosen prefix (``bits`` / ``histogram`` None: :func:`default_radix`). Returns (threshold [B]
    uint32, how many keys equal to it to take [B]).
    """
    if bits is None or histogram is None:
        default_bits, default_histogram = default_radix(keys.shape[1])
        bits, histogram = bits or default_bits, histogram or default_histogram
    if 32 % bits:
        raise ValueError(f"radix bits={bits} must divide 32 (valid: 2, 4, 8, 16)")
    batch = keys.shape[0]
    bins = 1 << bits
    prefix = jnp.zeros((batch,), jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        if shift == 32 - bits:
            alive = candidate
        else:
            alive = candidate & ((keys >> (shift + bits)) == (prefix[:, None] >> (shift + bits)))
        digit = ((keys >> shift) & (bins - 1)).astype(jnp.int32)
        hist = histogram_counts(digit, alive, bins, histogram)
        above = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1] - hist  # count with a larger digit
        # the digit d with above[d] < need <= above[d] + hist[d]
        hit = (above < need[:, None]) & (above + hist >= need[:, None])
        chosen = jnp.argmax(hit, axis=1).astype(jnp.uint32)
        need = need - jnp.take_along_axis(above, chosen[:, None].astype(jnp.int32), axis=1)[:, 0]
        prefix = prefix | (chosen << shift)
    return prefix, need


def compact_positions(chosen: jax.Array, k: int) -> jax.Array:
    """Positions where ``chosen [B, S]`` is True, in increasing order, padded with -1 to ``[B, k]``."""
    batch, seq = chosen.shape
    slot = jnp.cumsum(chosen.astype(jnp.int32), axis=1) - 1
    slot = jnp.where(chosen, slot, k)  # unchosen -> dropped
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    out = jnp.full((batch, k), -1, jnp.int32)
    return out.at[jnp.arange(batch)[:, None], slot].set(positions, mode="drop")


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window", "bits", "histogram"))
def select_top_k(scores: jax.Array, lengths: jax.Array, *, k: int, sinks: int = 0, window: int = 0,
                 bits: Optional[int] = None, histogram: Optional[str] = None) -> jax.Array:
    """Index set ``[B, k]`` (sorted; -1 padding): sinks + window + the top scores among the rest.

    Exact: equals a top-k by (score descending, position ascending) over the non-protected
    valid positions. ``scores [B, S]`` float32, ``lengths [B]`` valid history per row.
    ``bits``/``histogram``: radix digit width and how each pass counts (``scatter``: scatter-add;
    ``compare``: a fused compare-and-reduce without atomics; ``pallas``: all eight 4-bit passes
    in one Pallas kernel, one program per row, ``bits`` ignored); None: :func:`default_radix` for the row
    length. All variants give the same set.
    """
    batch, seq = scores.shape
    if sinks + window > k:
        raise ValueError(f"sinks={sinks} + window={window} exceed the budget k={k}")
    if k > seq:
        raise ValueError(f"budget k={k} larger than the cache capacity S={seq}")
    positions = jnp.arange(seq, dtype=jnp.int32)[None, :]
    lengths = lengths.astype(jnp.int32)[:, None]
    valid = positions < lengths
    protected = valid & ((positions < sinks) | (positions >= lengths - window))
    candidate = valid & ~protected
    remaining = k - jnp.sum(protected, axis=1)
    available = jnp.sum(candidate, axis=1)
    need = jnp.clip(jnp.minimum(remaining, available), 1, None)  # >= 1 keeps the search defined
    keys = order_preserving_keys(scores)
    if histogram == "pallas":
        interpret = jax.default_backend() != "gpu"
        threshold, equal_needed = radix_threshold_pallas(keys, candidate, need, interpret=interpret)
    else:
        threshold, equal_needed = radix_threshold(keys, candidate, need, bits=bits, histogram=histogram)
    greater = candidate & (keys > threshold[:, None])
    equal = candidate & (keys == threshold[:, None])
    equal_rank = jnp.cumsum(equal.astype(jnp.int32), axis=1)
    take = greater | (equal & (equal_rank <= equal_needed[:, None]))
    take = take & (jnp.minimum(remaining, available) > 0)[:, None]
    return compact_positions(protected | take, k)


# ---------------------------------------------------------------------------- I_verify
def _pad_width(scores: jax.Array, width: int) -> jax.Array:
    seq = scores.shape[1]
    return scores if seq >= width else jnp.pad(scores, ((0, 0), (0, width - seq)))


def indices_to_mask(indices: jax.Array, width: int) -> jax.Array:
    """``[B, K]`` positions (``-1`` = none) -> ``[B, width]`` bool membership."""
    safe = jnp.where((indices >= 0) & (indices < width), indices, width)  # negatives would wrap: drop them
    mask = jnp.zeros((indices.shape[0], width), bool)
    return mask.at[jnp.arange(indices.shape[0])[:, None], safe].set(True, mode="drop")


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window", "m"))
def select_verify_indices(s_draft: Optional[jax.Array], s_target: Optional[jax.Array], lengths: jax.Array, *,
                          k: int, sinks: int, window: int, m: int) -> jax.Array:
    """``I_verify [B, k]`` from ``s_draft``/``s_target [B, S]`` (either may be ``None`` when its share
    of the budget is zero) and ``lengths [B]`` (valid history positions per row)."""
    free = k - sinks - window
    if free < 0:
        raise ValueError(f"sinks={sinks} + window={window} exceed the budget k={k}")
    if not 0 <= m <= free:
        raise ValueError(f"m={m} must lie in 0..k - s - w = {free}")
    if m > 0 and s_draft is None:
        raise ValueError(f"m={m} > 0 needs the draft signal")
    if m < free and s_target is None:
        raise ValueError(f"m={m} < k - s - w = {free} needs the target signal")
    lengths = lengths.astype(jnp.int32)
    some = s_draft if s_draft is not None else s_target
    width = max(k, some.shape[1])  # a budget larger than the cache: pad (padding is never chosen)
    if m == 0:
        return select_top_k(_pad_width(s_target.astype(jnp.float32), width), lengths, k=k, sinks=sinks, window=window)
    if m == free:
        return select_top_k(_pad_width(s_draft.astype(jnp.float32), width), lengths, k=k, sinks=sinks,
                            window=window)
    # the per-row path with every row's m: the draft's part straight as a mask (the same exact radix select, ties
    # to the lower position); extracting its indices and scattering them back into a mask cost 1.0-1.16x as much
    # on an H100 (docs/methods.md §3.7)
    return select_verify_indices_rows(s_draft, s_target, lengths, jnp.full(lengths.shape, m, jnp.int32), k=k,
                                      sinks=sinks, window=window)


def select_for_config(config: DustinConfig, s_draft, s_target, lengths) -> jax.Array:
    """:func:`select_verify_indices` with the budget, sinks, window and m of ``config`` (its mode);
    ``config.m_rule`` "max-mass" / "coverage" / "entropy" (hybrid): the input-aware m of
    :func:`select_max_mass` / :func:`select_input_aware` / :func:`select_entropy_gated`."""
    m = config.effective_m
    if config.input_aware and config.m_rule == "max-mass":
        return select_max_mass(s_draft, s_target, lengths, k=config.budget, sinks=config.sinks,
                               window=config.window_size, balance=config.m_balance)
    if config.input_aware and config.m_rule == "entropy":
        return select_entropy_gated(s_draft, s_target, lengths, **entropy_rule_args(config))[0]
    if config.input_aware:
        return select_input_aware(s_draft, s_target, lengths, k=config.budget, sinks=config.sinks,
                                  window=config.window_size, candidates=config.m_candidates)[0]
    return select_verify_indices(s_draft if m > 0 else None, s_target if m < config.free_budget else None, lengths,
                                 k=config.budget, sinks=config.sinks, window=config.window_size, m=m)


def reuse_verify_indices(previous: jax.Array, selected_lengths: jax.Array, lengths: jax.Array, *, sinks: int,
                         window: int) -> jax.Array:
    """``I_verify`` of a round that reuses an earlier selection (docs/methods.md §3.8): the first ``sinks``
    positions, the positions ``previous`` chose from the signals (every entry in ``sinks .. selected_lengths -
    window - 1``: neither a sink nor in that round's window), and the last ``window`` positions of the
    history now (``lengths``). ``previous [B, k]`` must be a full selection (``selected_lengths > k``); the
    result has ``k`` distinct positions, sorted, like :func:`select_verify_indices`."""
    k = previous.shape[1]
    free = k - sinks - window
    keep = (previous >= sinks) & (previous < (selected_lengths.astype(jnp.int32) - window)[:, None])
    big = jnp.iinfo(jnp.int32).max
    chosen = jnp.sort(jnp.where(keep, previous, big), axis=1)[:, :free]
    batch = previous.shape[0]
    head = jnp.broadcast_to(jnp.arange(sinks, dtype=jnp.int32), (batch, sinks))
    tail = (lengths.astype(jnp.int32) - window)[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]
    return jnp.concatenate([head, chosen.astype(jnp.int32), tail], axis=1)


# ---------------------------------------------------------------------------- per-row m (docs/methods.md §3.7)
def top_rows_mask(scores: jax.Array, lengths: jax.Array, counts: jax.Array, *, sinks: int, window: int) -> jax.Array:
    """``[B, S]`` bool: sinks + window + the top ``counts[b] - #protected`` scores among the rest of row b
    (``counts [B]`` int32, traced: a per-row budget). The same exact radix select as
    :func:`select_top_k` (ties to the lower position)."""
    seq = scores.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)[None, :]
    lengths = lengths.astype(jnp.int32)[:, None]
    valid = positions < lengths
    protected = valid & ((positions < sinks) | (positions >= lengths - window))
    candidate = valid & ~protected
    wanted = counts.astype(jnp.int32) - jnp.sum(protected, axis=1)
    return protected | top_keys_mask(order_preserving_keys(scores), candidate, wanted)


def top_keys_mask(keys: jax.Array, alive: jax.Array, count: jax.Array) -> jax.Array:
    """``[R, n]`` bool: the top ``count [R]`` (at most the alive ones; 0: none) of the ``alive`` entries of each
    row by (``keys`` descending, then the earlier entry), by the exact radix threshold of :func:`select_top_k`."""
    want = jnp.minimum(count.astype(jnp.int32), jnp.sum(alive, axis=1))
    threshold, equal_needed = radix_threshold(keys, alive, jnp.clip(want, 1, None))
    greater = alive & (keys > threshold[:, None])
    equal = alive & (keys == threshold[:, None])
    take = greater | (equal & (jnp.cumsum(equal.astype(jnp.int32), axis=1) <= equal_needed[:, None]))
    return take & (want > 0)[:, None]


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window"))
def select_verify_indices_rows(s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array, m_rows: jax.Array, *,
                               k: int, sinks: int, window: int) -> jax.Array:
    """:func:`select_verify_indices` with a per-row ``m_rows [B]`` (int32, traced, each in
    ``0..k - s - w``): top ``m_rows[b]`` by ``s_D``, the rest of the budget by ``s_T``. Equals the
    fixed rule row by row (same two radix selections, so the same cost)."""
    free = k - sinks - window
    if free < 0:
        raise ValueError(f"sinks={sinks} + window={window} exceed the budget k={k}")
    width = max(k, s_draft.shape[1])
    s_draft = _pad_width(s_draft.astype(jnp.float32), width)
    s_target = _pad_width(s_target.astype(jnp.float32), width)
    lengths = lengths.astype(jnp.int32)
    m_rows = jnp.clip(m_rows.astype(jnp.int32), 0, free)
    first = top_rows_mask(s_draft, lengths, sinks + window + m_rows, sinks=sinks, window=window)
    lifted = jnp.where(first, jnp.inf, s_target)
    return select_top_k(lifted, lengths, k=k, sinks=sinks, window=window)


def _split_scores(scores: jax.Array, lengths: jax.Array, *, sinks: int, window: int) -> jax.Array:
    """``scores [B, S]`` clipped at 0 on each row's non-protected valid positions (the positions the
    split decides about), 0 elsewhere."""
    seq = scores.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)[None, :]
    lengths = lengths.astype(jnp.int32)[:, None]
    candidate = (positions < lengths) & (positions >= sinks) & (positions < lengths - window)
    return jnp.where(candidate, jnp.maximum(scores.astype(jnp.float32), 0.0), 0.0)


def signal_total(scores: jax.Array, lengths: jax.Array, *, sinks: int, window: int) -> jax.Array:
    """``[B, 1]``: the divisor of :func:`signal_mass`, each row's sum over :func:`_split_scores` (1 where
    that sum is 0); without writing the normalised signal."""
    total = jnp.sum(_split_scores(scores, lengths, sinks=sinks, window=window), axis=1, keepdims=True)
    return jnp.where(total > 0, total, 1.0)


def signal_mass(scores: jax.Array, lengths: jax.Array, *, sinks: int, window: int) -> jax.Array:
    """``scores [B, S]`` normalised to sum 1 over each row's non-protected valid positions (the
    positions the split decides about); a row without such positions is all zero."""
    return _split_scores(scores, lengths, sinks=sinks, window=window) / signal_total(scores, lengths, sinks=sinks,
                                                                                     window=window)


#: coverages within this of the best count as tied (the earlier candidate wins): two sums of the same
#: positions' mass taken in different orders differ by float rounding
COVERAGE_TIE = 1e-6


def first_best(covered: jax.Array) -> jax.Array:
    """``[B, C]`` coverages -> the first candidate within :data:`COVERAGE_TIE` of each row's best."""
    return jnp.argmax(covered >= jnp.max(covered, axis=1, keepdims=True) - COVERAGE_TIE, axis=1)


#: how :func:`select_input_aware` scores its candidates on the two selected lists: "sort" ranks each list with one
#: sort; "radix" takes each candidate's part by a radix threshold on the position-ordered lists and merges them, no
#: sort (on the 2-core CPU at k = 1024 1.22-1.49x the fixed rule against sort's 1.39-1.76x, bench-selection).
#: Default: radix on the CPU, sort elsewhere (docs/methods.md §3.7)
COVERAGE_SCORING = ("radix", "sort")


def after(listed: jax.Array) -> jax.Array:
    """``[B, 1]`` all True, computed from ``listed [B, n]`` (entries >= -1; n may be 0): a ``jnp.where`` on it makes
    a later width-sized pass wait for ``listed``, so XLA does not run two selections at once."""
    return jnp.min(listed, axis=1, initial=0, keepdims=True) >= -1


def _scored_by_sort(s_draft, s_target, lengths, *, k: int, sinks: int, window: int, candidates: tuple):
    """:func:`select_input_aware`'s candidates scored on both selected lists, each ranked by one sort (best
    first); the set is sorted from its members."""
    free = k - sinks - window
    batch, width = s_draft.shape
    rows = jnp.arange(batch)[:, None]

    def ranked(scores, count):  # the top `count` non-protected positions of each row, best first; -1 pads
        chosen = select_top_k(scores, lengths, k=sinks + window + count, sinks=sinks, window=window)
        keep = (chosen >= sinks) & (chosen < (lengths - window)[:, None])
        order_key = jnp.where(keep, ~order_preserving_keys(jnp.take_along_axis(scores, jnp.maximum(chosen, 0), 1)),
                              jnp.uint32(0xFFFFFFFF))
        # one sort carrying the positions (ties: the lower position, the input being sorted by position)
        _, by_rank = jax.lax.sort((order_key, jnp.where(keep, chosen, -1)), dimension=1, num_keys=1, is_stable=True)
        return by_rank[:, :count]

    m_max = max(int(c) for c in candidates)
    top_d = ranked(s_draft, m_max)  # [B, m_max]
    s_target = jnp.where(after(top_d), s_target, 0.0)  # after the draft's selection (see _scored_by_radix)
    top_t = ranked(s_target, free)  # [B, free]
    # each signal's mass at the ranked positions only: the row totals of signal_mass, and the scores
    # gathered at the [B, k] positions (no normalised copy of either signal over the width)
    total_d = signal_total(s_draft, lengths, sinks=sinks, window=window)
    total_t = signal_total(s_target, lengths, sinks=sinks, window=window)

    def mass_at(pos):
        safe = jnp.maximum(pos, 0)
        got = (jnp.maximum(jnp.take_along_axis(s_draft, safe, 1), 0.0) / total_d
               + jnp.maximum(jnp.take_along_axis(s_target, safe, 1), 0.0) / total_t)
        return jnp.where(pos >= 0, got, 0.0)

    # the draft rank of each of the target's positions (m_max: not among the draft's top)
    rank_of = jnp.full((batch, width), m_max, jnp.int32).at[rows, jnp.where(top_d >= 0, top_d, width)].set(
        jnp.broadcast_to(jnp.arange(m_max, dtype=jnp.int32), top_d.shape), mode="drop")
    t_rank_d = jnp.take_along_axis(rank_of, jnp.maximum(top_t, 0), 1)
    d_cum = jnp.concatenate([jnp.zeros((batch, 1)), jnp.cumsum(mass_at(top_d), axis=1)], axis=1)
    t_mass = mass_at(top_t)
    # every candidate at once ([B, C, free]): the target's fill skips the draft's first m
    ms = jnp.asarray(candidates, jnp.int32)
    fillable = (top_t >= 0)[:, None, :] & (t_rank_d[:, None, :] >= ms[None, :, None])
    fills = fillable & (jnp.cumsum(fillable.astype(jnp.int32), axis=2) <= (free - ms)[None, :, None])
    covered = d_cum[:, ms] + jnp.sum(jnp.where(fills, t_mass[:, None, :], 0.0), axis=2)
    best = first_best(covered)
    fill = fills[jnp.arange(batch), best]  # [B, free]
    m_best = ms[best]
    from_d = jnp.where(jnp.arange(m_max)[None, :] < m_best[:, None], top_d, -1)
    # the set in increasing order from its [B, ~2k] members, not a mask over the width: the sinks, the
    # window and the picked positions are disjoint (the ranked lists hold no protected position, and
    # the fill skips the draft's first m_best) and number at most k
    length = lengths[:, None]
    sink = jnp.arange(sinks, dtype=jnp.int32)[None, :]
    recent = length - window + jnp.arange(window, dtype=jnp.int32)[None, :]
    members = jnp.concatenate([jnp.where(sink < length, sink, -1),
                               jnp.where((recent >= sinks) & (recent >= 0), recent, -1),
                               from_d, jnp.where(fill, top_t, -1)], axis=1)
    none = jnp.iinfo(jnp.int32).max
    ordered = jax.lax.sort(jnp.where(members >= 0, members, none), dimension=1)[:, :k]
    return jnp.where(ordered == none, -1, ordered), m_best


def _scored_by_radix(s_draft, s_target, lengths, *, k: int, sinks: int, window: int, candidates: tuple):
    """:func:`select_input_aware`'s candidates scored without a sort: each candidate's draft part and its fill
    are radix thresholds on the two position-ordered lists, and the set is their merge."""
    free = k - sinks - window
    batch = s_draft.shape[0]
    rows = jnp.arange(batch)[:, None]
    m_max = max(int(c) for c in candidates)
    ms = jnp.asarray(candidates, jnp.int32)
    n_c = len(candidates)
    big = jnp.iinfo(jnp.int32).max
    per_candidate = lambda x: jnp.repeat(x, n_c, axis=0)  # noqa: E731  row b -> rows b*C .. b*C + C - 1

    def superset(scores, count):
        """The fixed rule's selection of ``count`` free positions (sorted, -1 pads), which of its entries are free
        (not a sink, not in the window), and their keys (position order is the list's order)."""
        chosen = select_top_k(scores, lengths, k=sinks + window + count, sinks=sinks, window=window)
        free_entry = (chosen >= sinks) & (chosen < (lengths - window)[:, None])
        keys = order_preserving_keys(jnp.take_along_axis(scores, jnp.maximum(chosen, 0), 1))
        return chosen, free_entry, keys

    # the draft's top m_max free positions hold every candidate's draft part (its top m); then the target's top
    # k - s - w hold every candidate's fill: its top k - s - w - m outside the draft's m reach at most m further
    top_d, free_d, key_d = superset(s_draft, m_max)
    # the target's selection made after the draft's, as in the fixed rule: left independent, XLA's CPU runtime
    # runs the two width-sized selections at once, which on two cores cost 1.6x running them one after the other
    # (bench-selection). A data dependency orders them (after: always true, computed from the draft's list)
    s_target = jnp.where(after(top_d), s_target, 0.0)
    top_t, free_t, key_t = superset(s_target, free)
    # each signal's mass at the listed positions only: the row totals of signal_mass, the scores gathered there
    total_d = signal_total(s_draft, lengths, sinks=sinks, window=window)
    total_t = signal_total(s_target, lengths, sinks=sinks, window=window)

    def mass_at(pos, alive):
        safe = jnp.maximum(pos, 0)
        got = (jnp.maximum(jnp.take_along_axis(s_draft, safe, 1), 0.0) / total_d
               + jnp.maximum(jnp.take_along_axis(s_target, safe, 1), 0.0) / total_t)
        return jnp.where(alive, got, 0.0)

    # every candidate at once, rows [B*C]: its draft part, then its fill among the target's entries not in it (the
    # lists are in position order, so top_keys_mask's ties to the earlier entry are select_top_k's to the lower position)
    in_d = top_keys_mask(per_candidate(key_d), per_candidate(free_d), jnp.tile(ms, batch))  # [B*C, s + w + m_max]
    # where each target entry sits in the draft's list (both sorted by position): one search, no width-sized map
    sorted_d, sorted_t = jnp.where(top_d >= 0, top_d, big), jnp.where(top_t >= 0, top_t, big)
    t_in_d = jax.vmap(jnp.searchsorted)(sorted_d, sorted_t)  # draft entries before each target entry
    at = jnp.minimum(t_in_d, top_d.shape[1] - 1)
    listed = (jnp.take_along_axis(sorted_d, at, 1) == top_t) & (top_t >= 0)  # [B, k]
    taken_t = per_candidate(listed) & jnp.take_along_axis(in_d, per_candidate(at), 1)
    fill = top_keys_mask(per_candidate(key_t), per_candidate(free_t) & ~taken_t, jnp.tile(free - ms, batch))  # [B*C, k]
    covered = (jnp.sum(jnp.where(in_d, per_candidate(mass_at(top_d, free_d)), 0.0), axis=1)
               + jnp.sum(jnp.where(fill, per_candidate(mass_at(top_t, free_t)), 0.0), axis=1)).reshape(batch, n_c)
    best = first_best(covered)
    pick = jnp.arange(batch) * n_c + best
    # the set in increasing order: the draft list's sinks, window and chosen entries merged with the target list's
    # fill (disjoint, each in position order), each entry's slot its rank in its own list plus the other list's
    # entries before it (no sort, no mask over the width)
    keep_d = ((top_d >= 0) & ~free_d) | in_d[pick]
    keep_t = fill[pick]
    count_d, count_t = jnp.cumsum(keep_d.astype(jnp.int32), axis=1), jnp.cumsum(keep_t.astype(jnp.int32), axis=1)

    def kept_before(counts, entries):  # kept entries among the first `entries` of a list
        return jnp.where(entries > 0, jnp.take_along_axis(counts, jnp.maximum(entries - 1, 0), 1), 0)

    d_in_t = jax.vmap(jnp.searchsorted)(sorted_t, sorted_d)  # target entries before each draft entry
    slot_d = jnp.where(keep_d, count_d - 1 + kept_before(count_t, d_in_t), k)
    slot_t = jnp.where(keep_t, count_t - 1 + kept_before(count_d, t_in_d), k)
    out = jnp.full((batch, k), -1, jnp.int32)
    out = out.at[rows, slot_d].set(top_d, mode="drop").at[rows, slot_t].set(top_t, mode="drop")
    return out, ms[best]


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window", "candidates", "scoring"))
def select_input_aware(s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array, *, k: int, sinks: int,
                       window: int, candidates: tuple, scoring: Optional[str] = None):
    """Input-aware m (docs/methods.md §3.7): per row, the candidate m (static tuple, the profiled m
    first) whose hybrid selection covers the most of both signals' mass,
    ``sum_{i in I(m)} (s_D[i] / sum s_D + s_T[i] / sum s_T)`` over the non-protected positions; ties
    (within :data:`COVERAGE_TIE`) keep the earlier candidate (the profiled m). Returns (``I_verify [B, k]``,
    chosen m ``[B]`` int32).

    Two radix selections, as the fixed rule: every candidate's ``I(m)`` is the first m of the draft
    signal's top ``max(candidates)`` in rank order, then the target signal's ranking with those
    skipped, and that ranking never reaches past its own top ``k - s - w`` (at most m of those are
    skipped). So both lists are selected once, and each candidate is scored on them alone (``[B, k]``-sized
    work). ``scoring`` (:data:`COVERAGE_SCORING`; None: radix on the CPU, sort elsewhere) is how: both give the
    same set. Equals :func:`select_input_aware_reference`."""
    if not candidates:
        raise ValueError("candidates must name at least one m")
    free = k - sinks - window
    if free < 0:
        raise ValueError(f"sinks={sinks} + window={window} exceed the budget k={k}")
    if any(not 0 <= int(c) <= free for c in candidates):
        raise ValueError(f"candidates {candidates} must each lie in 0..k - s - w = {free}")
    batch, seq = s_draft.shape
    width = max(k, seq)
    s_draft = _pad_width(s_draft.astype(jnp.float32), width)
    s_target = _pad_width(s_target.astype(jnp.float32), width)
    lengths = lengths.astype(jnp.int32)
    if scoring is None:
        scoring = "radix" if jax.default_backend() == "cpu" else "sort"
    if scoring not in COVERAGE_SCORING:
        raise ValueError(f"scoring={scoring!r}; valid: {', '.join(COVERAGE_SCORING)}")
    score = _scored_by_radix if scoring == "radix" else _scored_by_sort
    return score(s_draft, s_target, lengths, k=k, sinks=sinks, window=window, candidates=tuple(candidates))


@functools.partial(jax.jit, static_argnames=("config",))
def select_held(config: DustinConfig, s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array, m_rows: jax.Array,
                decide) -> Tuple[jax.Array, jax.Array]:
    """The coverage rule deciding only in some rounds (``DustinConfig.m_every``, docs/methods.md §3.7):
    where ``decide`` (a traced bool scalar) holds, :func:`select_input_aware` (the rule's set and its m per row);
    otherwise the fixed rule with each row's held ``m_rows [B]`` (:func:`select_verify_indices_rows`, the fixed
    rule's two radix selections, no candidate scoring). Returns ``(I_verify [B, k], m [B] int32)``. Jitted:
    ``config`` is static. The portable form (``m_every_schedule="cond"``); :func:`select_scheduled` is the
    same with the decision fixed at compile time."""
    return jax.lax.cond(decide, lambda: select_scheduled(config, s_draft, s_target, lengths, m_rows, decide=True),
                        lambda: select_scheduled(config, s_draft, s_target, lengths, m_rows, decide=False))


@functools.partial(jax.jit, static_argnames=("config", "decide"))
def select_scheduled(config: DustinConfig, s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array,
                     m_rows: jax.Array, *, decide: bool) -> Tuple[jax.Array, jax.Array]:
    """:func:`select_held` with the decision known when the round is compiled (``decide``, a Python bool): a
    deciding round runs :func:`select_input_aware`, a holding round :func:`select_verify_indices_rows` with
    ``m_rows``, and neither carries a conditional. The unrolled decoding loop (``m_every_schedule="unrolled"``,
    docs/methods.md §3.7) compiles one round of each kind. Returns ``(I_verify [B, k], m [B] int32)``."""
    k, sinks, window = config.budget, config.sinks, config.window_size
    if decide:
        return select_input_aware(s_draft, s_target, lengths, k=k, sinks=sinks, window=window,
                                  candidates=config.m_candidates)
    m_rows = m_rows.astype(jnp.int32)
    return select_verify_indices_rows(s_draft, s_target, lengths, m_rows, k=k, sinks=sinks, window=window), m_rows


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window", "candidates"))
def select_input_aware_reference(s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array, *, k: int, sinks: int,
                       window: int, candidates: tuple):
    """:func:`select_input_aware` the direct way, the test oracle: every candidate's hybrid selection
    made in full (rows ``B x C``, two radix selections each), its coverage summed over the whole
    width. ``C`` times the fixed rule's work."""
    if not candidates:
        raise ValueError("candidates must name at least one m")
    batch, seq = s_draft.shape
    c = len(candidates)
    width = max(k, seq)
    s_draft = _pad_width(s_draft.astype(jnp.float32), width)
    s_target = _pad_width(s_target.astype(jnp.float32), width)
    mass = (signal_mass(s_draft, lengths, sinks=sinks, window=window)
            + signal_mass(s_target, lengths, sinks=sinks, window=window))
    rep = lambda x: jnp.repeat(x, c, axis=0)  # noqa: E731  row b -> rows b*C .. b*C + C - 1
    m_rows = jnp.tile(jnp.asarray(candidates, jnp.int32), batch)
    indices = select_verify_indices_rows(rep(s_draft), rep(s_target), rep(lengths), m_rows, k=k, sinks=sinks,
                                         window=window)
    covered = jnp.sum(jnp.where(indices_to_mask(indices, width), rep(mass), 0.0), axis=1).reshape(batch, c)
    best = first_best(covered)
    chosen = indices.reshape(batch, c, k)[jnp.arange(batch), best]
    return chosen, jnp.asarray(candidates, jnp.int32)[best]


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window", "balance"))
def select_max_mass(s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array, *, k: int, sinks: int, window: int,
                    balance: float) -> jax.Array:
    """Input-aware m by ranking (docs/methods.md §3.7): sinks + window + the top ``k - s - w`` positions
    by ``max(p_D[i], balance * p_T[i])``, ``p`` = each signal normalised over the non-protected
    positions. The set is a hybrid selection (a top set of ``s_D`` united with a top set of
    ``s_T``), its split m per row set by where each signal's mass lies; one radix selection."""
    width = max(k, s_draft.shape[1])
    s_draft = _pad_width(s_draft.astype(jnp.float32), width)
    s_target = _pad_width(s_target.astype(jnp.float32), width)
    score = jnp.maximum(signal_mass(s_draft, lengths, sinks=sinks, window=window),
                        jnp.float32(balance) * signal_mass(s_target, lengths, sinks=sinks, window=window))
    return select_top_k(score, lengths, k=k, sinks=sinks, window=window)


@functools.partial(jax.jit, static_argnames=("sinks", "window", "balance"))
def max_mass_split(s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array, indices: jax.Array, *, sinks: int,
                   window: int, balance: float) -> jax.Array:
    """The split m ``[B]`` of a :func:`select_max_mass` set ``indices``: its chosen non-protected positions
    whose draft mass reaches the selection threshold (those a top-m of ``s_D`` holds)."""
    width = max(indices.shape[1], s_draft.shape[1])
    p_d = signal_mass(_pad_width(s_draft.astype(jnp.float32), width), lengths, sinks=sinks, window=window)
    p_t = signal_mass(_pad_width(s_target.astype(jnp.float32), width), lengths, sinks=sinks, window=window)
    score = jnp.maximum(p_d, jnp.float32(balance) * p_t)
    positions = jnp.arange(width)[None, :]
    lengths = lengths.astype(jnp.int32)[:, None]
    free = (positions >= sinks) & (positions < lengths - window) & indices_to_mask(indices, width)
    threshold = jnp.min(jnp.where(free, score, jnp.inf), axis=1, keepdims=True)
    return jnp.sum(free & (p_d >= threshold), axis=1).astype(jnp.int32)


# ---------------------------------------------------------------------------- entropy-gated m (docs/methods.md §3.7)
def entropy_rule_args(config: DustinConfig) -> dict:
    """The static arguments of :func:`select_entropy_gated` for ``config`` (its m, step and dead zone)."""
    m, free = config.effective_m, config.free_budget
    step = min(max(int(round(config.m_spread * free)), 1), free)
    return dict(k=config.budget, sinks=config.sinks, window=config.window_size, m=m, step=step,
                centre=float(config.m_entropy_centre), band=float(config.m_entropy_band))


def normalised_entropy(p: jax.Array, count: jax.Array) -> jax.Array:
    """``H(p) / log(count)`` per row of ``p [B, S]`` (a distribution over ``count [B]`` positions); 0 for a
    row with at most one position."""
    h = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=1)
    n = count.astype(jnp.float32)
    return jnp.where(n > 1, h / jnp.log(jnp.maximum(n, 2.0)), 0.0)


@functools.partial(jax.jit, static_argnames=("sinks", "window"))
def signal_entropy_gap(s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array, *, sinks: int,
                       window: int) -> jax.Array:
    """``H(p_T) - H(p_D)`` ``[B]``: the normalised entropies of the two signals over the non-protected
    positions (:func:`signal_mass`), each divided by the log of their number (so in [-1, 1])."""
    seq = s_draft.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)[None, :]
    lengths = lengths.astype(jnp.int32)
    count = jnp.sum((positions >= sinks) & (positions < lengths[:, None] - window), axis=1)
    p_d = signal_mass(s_draft, lengths, sinks=sinks, window=window)
    p_t = signal_mass(s_target, lengths, sinks=sinks, window=window)
    return normalised_entropy(p_t, count) - normalised_entropy(p_d, count)


def entropy_gated_m(gap: jax.Array, *, m: int, step: int, free: int, centre: float, band: float) -> jax.Array:
    """Per-row m ``[B]`` from the entropy gap: ``m + step`` above ``centre + band`` (the target signal
    flatter than usual: the draft's lookahead gets more of the budget), ``m - step`` below
    ``centre - band`` (the target signal sharper: it gets more), else ``m``; clipped to ``0..free``."""
    up = (gap > centre + band).astype(jnp.int32)
    down = (gap < centre - band).astype(jnp.int32)
    return jnp.clip(m + step * (up - down), 0, free).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window", "m", "step", "centre", "band"))
def select_entropy_gated(s_draft: jax.Array, s_target: jax.Array, lengths: jax.Array, *, k: int, sinks: int,
                         window: int, m: int, step: int, centre: float, band: float):
    """Input-aware m by an entropy dead zone (docs/methods.md §3.7): per row, the profiled ``m`` unless
    ``H(p_T) - H(p_D)`` (:func:`signal_entropy_gap`) leaves ``centre -/+ band``, then ``m -/+ step``
    (:func:`entropy_gated_m`); the set is the fixed rule's at that m (:func:`select_verify_indices_rows`:
    the same two radix selections, plus two elementwise passes over the signals). Returns
    (``I_verify [B, k]``, chosen m ``[B]`` int32)."""
    free = k - sinks - window
    if not 0 <= m <= free:
        raise ValueError(f"m={m} must lie in 0..k - s - w = {free}")
    width = max(k, s_draft.shape[1])
    s_draft = _pad_width(s_draft.astype(jnp.float32), width)
    s_target = _pad_width(s_target.astype(jnp.float32), width)
    gap = signal_entropy_gap(s_draft, s_target, lengths, sinks=sinks, window=window)
    m_rows = entropy_gated_m(gap, m=m, step=step, free=free, centre=centre, band=band)
    indices = select_verify_indices_rows(s_draft, s_target, lengths, m_rows, k=k, sinks=sinks, window=window)
    return indices, m_rows
