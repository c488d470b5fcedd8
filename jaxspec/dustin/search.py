"""Offline profiling of one target–draft pair (docs/methods.md §3.4): calibration rounds, Algorithm 1, the profile.

1. :func:`collect_calibration` runs greedy speculative decoding with **full-KV** verification
   on calibration prompts. Every round (and active row) it records, over the history positions:
   the ARR recall weights of the full-KV verification (:mod:`jaxspec.dustin.arr`), the target
   signal ``s_T`` of **every** target layer (that layer's SRHs, query of the last committed
   token) and the draft signal ``s_D`` of **every** draft layer (that layer's SRHs, the gamma
   drafting steps). Any selection's ARR is then a dot product with the recall weights.
2. :func:`algorithm1` (greedy): (a) the target layer whose target-only selection has the best
   ARR; (b) draft layers added one at a time, each time the one giving the best hybrid ARR,
   while it improves by at least ``min_gain`` (0.1 pp) and at most ``max_draft_layers`` (4);
   the hybrid ARR of a layer set is its best over m (choice: the paper does not say which m
   step (b) uses); (c) m by an exhaustive sweep over ``0 .. k - s - w`` (:func:`sweep_m`,
   vectorised and exact; ties: the smallest m).
3. :class:`DustinProfile` -- per-budget :class:`DustinConfig` plus provenance (models, data,
   date, SRHs, search trace), saved to / loaded from JSON with clear errors.
4. :func:`profile_pair` -- the whole pipeline from a calibration :class:`~jaxspec.data.TaskSuite`
   (refused unless its tasks are calibration-split, and checked disjoint from an evaluation
   suite when one is given).

Sweep (exact): in a row with protected set P and free budget R, the union for a given m is
``P + Dtop(m) + Fill(m)`` where Fill(m) is the first ``R - m`` positions in ``s_T`` order not in
Dtop(m). Fill(m) lies within the first R positions of the ``s_T`` order, so one ``[M+1, R]``
matrix per row evaluates every m at once (``M = k - s - w``).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import pathlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import pad_prompts, prefill
from jaxspec.decoding.speculative import EngineConfig, commit_phase, draft_phase, loop_state_from_caches
from jaxspec.dustin.arr import all_heads, recall_of_indices, recall_weights
from jaxspec.dustin.config import SUPPORTED_BUDGETS, DustinConfig, check_budget, default_window
from jaxspec.dustin.policy import DustinDraft, DustinSelfDraft, last_prompt_query
from jaxspec.dustin.selection import select_input_aware, select_verify_indices
from jaxspec.dustin.signals import fit_width, head_scores, target_signal
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward

PROFILE_FORMAT = 1


class ProfileError(ValueError):
    """A Dustin profile file is missing, corrupt, or does not fit the request."""


# ---------------------------------------------------------------------------- calibration rounds
@dataclasses.dataclass
class CalibrationRecords:
    """One item per (round, active row) of the calibration decoding.

    ``weights [N, S]``: ARR recall weights; ``target_scores [L_T, N, S]``: ``s_T`` per target
    layer with ``target_heads[l]``; ``draft_scores [L_D, N, S]``: ``s_D`` per draft layer with
    ``draft_heads[l]``; ``lengths [N]``: history positions.
    """

    weights: np.ndarray
    target_scores: np.ndarray
    draft_scores: np.ndarray
    lengths: np.ndarray
    target_heads: Tuple[Tuple[int, ...], ...]
    draft_heads: Tuple[Tuple[int, ...], ...]
    gamma: int
    #: ``[N]``: which decoded sequence each item is a round of (items of one sequence in round order); None
    #: when not recorded
    sequence: Optional[np.ndarray] = None

    @property
    def num_items(self) -> int:
        return int(self.lengths.shape[0])


def _heads_tuple(heads) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(int(h) for h in hs) for hs in heads)


def _calibration_round_fn(target_params, draft_params, state, *, target_config, draft_config, draft_policy, engine,
                          target_heads):
    proposal, key = draft_phase(target_params, draft_params, state.draft_state, state.target_cache, state.pending,
                                 state.previous, state.committed, state.key, target_config=target_config,
                                 draft_policy=draft_policy, engine=engine)
    lengths = state.committed - 1
    cache = proposal.target_cache.with_lengths(lengths)
    rows = jnp.concatenate([state.pending[:, None], proposal.tokens], axis=1)
    out = forward(target_params, rows, cache, config=target_config, probe_heads=all_heads(target_config))
    weights = recall_weights(out.probes.history_probs, lengths)
    num_heads = target_config.num_heads
    query = state.verify_state["query"]  # [B, L*H, D]: every head of the last committed token
    s_target = jnp.stack([
        target_signal(query[:, [layer * num_heads + h for h in heads]], cache.keys[layer], lengths, heads,
                      target_config.queries_per_kv)
        for layer, heads in enumerate(target_heads)])
    signals = proposal.signals
    s_draft, start = [], 0
    for layer_keys, heads in zip(signals.keys, draft_policy.heads):
        part = signals.queries[:, start:start + len(heads)]
        start += len(heads)
        scores = head_scores(part, layer_keys, lengths, heads, draft_config.queries_per_kv)
        s_draft.append(fit_width(scores, cache.capacity))
    active = ~state.done
    new = commit_phase(state, proposal, out.logits, out.cache, key, engine=engine)
    num_committed = new.committed - state.committed
    row = jnp.maximum(num_committed - 1, 0)[:, None, None, None]
    last = jnp.take_along_axis(out.probes.queries, row, axis=2)[:, :, 0]
    new = new._replace(verify_state={"query": jnp.where((num_committed > 0)[:, None, None], last, query)})
    return new, (weights, s_target, jnp.stack(s_draft), lengths, active)


_calibration_round = jax.jit(_calibration_round_fn, static_argnames=(
    "target_config", "draft_config", "draft_policy", "engine", "target_heads"))


def collect_calibration(target_params, target_config: ModelConfig, draft_params, draft_config: Optional[ModelConfig],
                        prompts: Sequence[Sequence[int]], *, target_heads, draft_heads, gamma: int = 4,
                        max_new_tokens: int = 32, batch_size: int = 4, self_draft_mask=None,
                        draft_layers: Optional[Sequence[int]] = None) -> CalibrationRecords:
    """Greedy SD with full-KV verification on ``prompts``; records per round (see the module doc).

    ``target_heads``: per target layer its SRH heads (e.g. ``SRHResult.top_heads()``);
    ``draft_heads``: per candidate draft layer its SRH heads (layers ``draft_layers``, default
    ``0 .. len(draft_heads) - 1``). A self-draft: ``draft_config=None`` and ``self_draft_mask``
    (``[L, 2]``; the candidate draft layers must execute their attention).
    """
    target_heads = _heads_tuple(target_heads)
    draft_heads = _heads_tuple(draft_heads)
    if len(target_heads) != target_config.num_layers:
        raise ValueError(f"target_heads has {len(target_heads)} layers; the target has {target_config.num_layers}")
    layers = tuple(range(len(draft_heads))) if draft_layers is None else tuple(int(x) for x in draft_layers)
    if not draft_heads or len(layers) != len(draft_heads):
        raise ValueError("give SRH heads for every candidate draft layer (draft_heads, draft_layers)")
    engine = EngineConfig(gamma=gamma, max_new_tokens=max_new_tokens)
    if draft_config is None:
        if self_draft_mask is None:
            raise ValueError("a self-draft calibration needs self_draft_mask")
        policy = DustinSelfDraft(config=target_config, layers=layers, heads=draft_heads)
        draft_params, draft_cfg = target_params, target_config
    else:
        policy = DustinDraft(config=draft_config, layers=layers, heads=draft_heads)
        draft_cfg = draft_config
    items: List[Tuple[np.ndarray, ...]] = []
    for start in range(0, len(prompts), batch_size):
        tokens, lengths = pad_prompts(prompts[start:start + batch_size])
        batch = len(lengths)
        capacity = int(lengths.max()) + max_new_tokens + gamma + 2
        cache = init_cache(target_config, batch, capacity)
        cache, first_logits = prefill(target_params, target_config, tokens, lengths, cache)
        draft_state = (policy.initial_state(self_draft_mask) if draft_config is None
                       else policy.prefill(draft_params, tokens, lengths, capacity))
        last = tokens[np.arange(batch), lengths - 1]
        query = last_prompt_query(target_params, jnp.asarray(last[:, None], jnp.int32),
                                   cache.with_lengths(jnp.asarray(lengths - 1)), config=target_config,
                                   probe_heads=all_heads(target_config))
        first = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)
        state = loop_state_from_caches(cache, draft_state, first, jnp.asarray(last, jnp.int32), engine,
                                       verify_state={"query": query})
        while int(state.round) < max_new_tokens and not bool(jnp.all(state.done)):
            state, record = _calibration_round(target_params, draft_params, state, target_config=target_config,
                                               draft_config=draft_cfg, draft_policy=policy, engine=engine,
                                               target_heads=target_heads)
            weights, s_target, s_draft, hist, active = (np.asarray(x) for x in record)
            keep = np.nonzero(active)[0]
            if keep.size:
                items.append((weights[keep], s_target[:, keep], s_draft[:, keep], hist[keep], start + keep))
    if not items:
        raise ValueError("calibration produced no rounds")
    width = max(item[0].shape[1] for item in items)

    def pad(x):
        return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])

    return CalibrationRecords(
        weights=np.concatenate([pad(i[0]) for i in items]).astype(np.float32),
        target_scores=np.concatenate([pad(i[1]) for i in items], axis=1).astype(np.float32),
        draft_scores=np.concatenate([pad(i[2]) for i in items], axis=1).astype(np.float32),
        lengths=np.concatenate([i[3] for i in items]).astype(np.int32),
        target_heads=target_heads, draft_heads=draft_heads, gamma=gamma,
        sequence=np.concatenate([i[4] for i in items]).astype(np.int32))


# ---------------------------------------------------------------------------- ARR of selections
def _pad_to(x: np.ndarray, width: int) -> np.ndarray:
    return x if x.shape[-1] >= width else np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def selection_arr(weights, s_draft, s_target, lengths, *, k: int, sinks: int, window: int, m: int,
                  chunk: int = 256) -> float:
    """Mean ARR over items of the exact selection (:func:`select_verify_indices`) with this m."""
    width = max(k, weights.shape[1])
    total = 0.0
    for start in range(0, len(lengths), chunk):
        part = slice(start, start + chunk)
        w = jnp.asarray(_pad_to(weights[part], width))
        d = None if s_draft is None or m == 0 else jnp.asarray(_pad_to(s_draft[part], width))
        t = None if s_target is None else jnp.asarray(_pad_to(s_target[part], width))
        indices = select_verify_indices(d, t, jnp.asarray(lengths[part]), k=k, sinks=sinks, window=window, m=m)
        total += float(jnp.sum(recall_of_indices(w, indices)))
    return total / len(lengths)


def _sweep_row(w, s_draft, s_target, length, *, k, sinks, window):
    """ARR of every m in ``0 .. k - s - w`` for one row (``[M + 1]``); see the module doc."""
    seq = w.shape[0]
    free = k - sinks - window
    pos = jnp.arange(seq)
    valid = pos < length
    protected = valid & ((pos < sinks) | (pos >= length - window))
    cand = valid & ~protected
    budget = k - jnp.sum(protected)  # R: positions left for the signals
    num_cand = jnp.sum(cand)
    w = jnp.where(valid, w, 0.0)
    w_protected = jnp.sum(jnp.where(protected, w, 0.0))
    w_cand = jnp.where(cand, w, 0.0)
    order_d = jnp.argsort(jnp.where(cand, -s_draft, jnp.inf), stable=True)  # score desc, position asc
    rank_d = jnp.zeros(seq, jnp.int32).at[order_d].set(jnp.arange(seq, dtype=jnp.int32))
    order_t = jnp.argsort(jnp.where(cand, -s_target, jnp.inf), stable=True)[:free]
    prefix_d = jnp.concatenate([jnp.zeros(1), jnp.cumsum(w_cand[order_d][:free])])  # [M+1]
    m = jnp.arange(free + 1)[:, None]
    eligible = cand[order_t][None, :] & (rank_d[order_t][None, :] >= m)  # [M+1, M]
    quota = budget - jnp.minimum(m, num_cand)
    fill = eligible & (jnp.cumsum(eligible.astype(jnp.int32), axis=1) <= quota)
    return w_protected + prefix_d + jnp.sum(jnp.where(fill, w_cand[order_t][None, :], 0.0), axis=1)


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window"))
def _sweep_chunk(w, s_draft, s_target, lengths, *, k, sinks, window):
    return jax.vmap(functools.partial(_sweep_row, k=k, sinks=sinks, window=window))(w, s_draft, s_target, lengths)


def sweep_m(weights, s_draft, s_target, lengths, *, k: int, sinks: int, window: int, chunk: int = 16) -> np.ndarray:
    """Mean ARR (over items) of the selection for every m in ``0 .. k - s - w``: ``[k - s - w + 1]``.

    Exact: entry m equals :func:`selection_arr` with that m (tests check it)."""
    free = k - sinks - window
    if free < 0:
        raise ValueError(f"sinks={sinks} + window={window} exceed the budget k={k}")
    width = max(k, weights.shape[1])
    total = np.zeros(free + 1, np.float64)
    for start in range(0, len(lengths), chunk):
        part = slice(start, start + chunk)
        arrs = _sweep_chunk(jnp.asarray(_pad_to(weights[part], width)), jnp.asarray(_pad_to(s_draft[part], width)),
                            jnp.asarray(_pad_to(s_target[part], width)), jnp.asarray(lengths[part]),
                            k=k, sinks=sinks, window=window)
        total += np.asarray(arrs, np.float64).sum(axis=0)
    return total / len(lengths)


#: the rounds :func:`m_choice_study` holds the coverage rule's decision for (``coverage_held{r}``)
HOLD_ROUNDS = (3,)


def m_choice_study(records: CalibrationRecords, config: DustinConfig, *, target_layer: int = 0,
                   draft_layers: Optional[Sequence[int]] = None, length_m: Optional[int] = None,
                   hold: Sequence[int] = HOLD_ROUNDS) -> Dict[str, Any]:
    """How predictable the ARR-maximising m of a round is (docs/methods.md §3.7), per round of each
    recorded sequence, from its ARR curve (:func:`sweep_m`):

    * ``fixed``: the profile's m every round; ``oracle``: the round's best m (needs the full-KV
      verification, an upper bound);
    * ``persistence``: the previous round's best m (the first round: the fixed m) -- what a rule that
      learns m from finished rounds gets if the best m persists from round to round;
    * ``signal_proxy``: the m that would maximise the round's ARR if the target's historical signal
      ``s_T`` of the **next** round (the last committed token's SRH attention over the history, the one
      target-side view of the verification a sparse round has) stood in for the recall weights -- not
      causal for this round, so an optimistic bound for rules scoring m against ``s_T``;
    * ``hindsight``: a causal rule built on that proxy: the candidate among m and m -/+ one coverage
      step (:attr:`DustinConfig.m_candidates`) that would have covered the most of this round's ``s_T``
      with the previous round's signals (ties keep m);
    * ``best_fixed``: one m for every round, the one with the highest mean ARR over these rounds (an
      upper bound on recalibrating the fixed m for this data); ``best_fixed_crossval``: the same m chosen
      on the other half of the sequences (even / odd sequence ids, two folds) and scored on this half --
      what recalibrating the fixed m on held-out sequences of this kind and length gets
      (``best_fixed_m``: the m of each);
    * ``coverage``: the coverage rule (``DustinConfig.m_rule = "coverage"``, its candidates around the
      profile's m) applied to each round's own signals, as it decides online; ``coverage_crossval``: the
      same rule with its candidates around the held-out best single m (``best_fixed_m["folds"]``);
    * with ``length_m`` (the profile's m for this context length, :meth:`DustinProfile.m_at`, recalibrated on
      calibration tasks of that length): ``length_m``, that m every round, and ``coverage_length_m``, the
      coverage rule with its candidates around it;
    * ``coverage_held{r}`` (and ``coverage_length_m_held{r}``) for each r of ``hold``: the coverage rule deciding
      only in every r-th round of a sequence (its first, then every r-th), each row's m held in the rounds
      between, where the fixed rule selects with it -- a selection costs the rule's extra work once in r
      rounds.

    ``records.target_scores[target_layer]`` is ``s_T`` (recorded with ``config.target_heads``);
    ``s_D`` sums ``records.draft_scores`` over ``draft_layers`` (their indices among the recorded draft
    layers; default all). Each value is the mean ARR over rounds; ``gap_closed`` is ``(value − fixed) /
    (oracle − fixed)``; ``oracle_m`` the mean and spread of the best m."""
    if records.sequence is None:
        raise ValueError("m_choice_study needs records with their sequence ids (collect_calibration records them)")
    k, sinks, window, m0 = config.budget, config.sinks, config.window_size, config.effective_m
    free = k - sinks - window
    cands = tuple(config.m_candidates)
    layers = list(range(records.draft_scores.shape[0])) if draft_layers is None else list(draft_layers)
    s_d_all = records.draft_scores[layers].sum(axis=0)
    s_t_all = records.target_scores[target_layer]
    width = records.weights.shape[1]
    pos = np.arange(width)

    def curve(w, s_d, s_t, length):
        return sweep_m(w[None], s_d[None], s_t[None], np.array([length]), k=k, sinks=sinks, window=window)

    values = {name: [] for name in ("fixed", "oracle", "persistence", "signal_proxy", "hindsight")}
    best_ms, curves, seq_of, row_of, round_of = [], [], [], [], []
    for seq in np.unique(records.sequence):
        rows = np.nonzero(records.sequence == seq)[0]
        previous = None  # (s_D, s_T, length, best m) of the sequence's previous round
        for i, row in enumerate(rows):
            length = int(records.lengths[row])
            s_d, s_t = s_d_all[row], s_t_all[row]
            arr = curve(records.weights[row], s_d, s_t, length)
            curves.append(arr)
            seq_of.append(seq)
            row_of.append(row)
            round_of.append(i)
            best = int(np.argmax(arr))
            best_ms.append(best)
            values["fixed"].append(arr[m0])
            values["oracle"].append(arr[best])
            if i + 1 < len(rows):  # the next round's s_T as this round's weights
                nxt = s_t_all[rows[i + 1]] * (pos < length)
                proxy = curve(nxt / max(float(nxt.sum()), 1e-30), s_d, s_t, length)
                values["signal_proxy"].append(arr[int(np.argmax(proxy))])
            else:
                values["signal_proxy"].append(arr[m0])
            if previous is None:
                m_persist = m_hind = m0
            else:
                p_d, p_t, p_len, p_best = previous
                now = s_t * (pos < p_len)
                past = curve(now / max(float(now.sum()), 1e-30), p_d, p_t, p_len)
                scores = np.array([past[min(m, free)] for m in cands])
                m_persist = p_best
                m_hind = m0 if scores.max() - past[m0] <= 1e-6 else int(cands[int(np.argmax(scores))])
            values["persistence"].append(arr[m_persist])
            values["hindsight"].append(arr[m_hind])
            previous = (s_d, s_t, length, best)
    means = {name: float(np.mean(v)) for name, v in values.items()}
    curves, seq_of, row_of = np.stack(curves), np.asarray(seq_of), np.asarray(row_of)
    m_best, means["best_fixed"] = best_m(curves.mean(axis=0))

    def coverage_m(center: int, held) -> np.ndarray:  # the coverage rule's m in each held round
        cands = dataclasses.replace(config, m=int(center)).m_candidates
        rows_ = row_of[held]
        _, chosen = select_input_aware(jnp.asarray(s_d_all[rows_]), jnp.asarray(s_t_all[rows_]),
                                       jnp.asarray(records.lengths[rows_], jnp.int32), k=k, sinks=sinks,
                                       window=window, candidates=tuple(cands))
        return np.asarray(chosen)

    def coverage_arr(center: int, held) -> np.ndarray:  # each held round's ARR at the coverage rule's m
        return curves[held, coverage_m(center, held)]

    round_of = np.asarray(round_of)
    everything = np.arange(len(curves))
    hold = [int(r) for r in hold]
    if any(r < 2 for r in hold):
        raise ValueError(f"hold={hold}: each must be >= 2 rounds (1 is the rule deciding every round, 'coverage')")

    def with_held(name: str, center: int) -> None:
        """``means[name]`` (the rule every round) and ``means[name_held{r}]`` from one pass of the rule: a
        sequence's rounds are consecutive, so each takes the m of its last deciding round."""
        chosen = coverage_m(center, everything)
        means[name] = float(curves[everything, chosen].mean())
        for r in hold:
            means[f"{name}_held{r}"] = float(curves[everything, chosen[everything - round_of % r]].mean())

    if 0 < m0 < free:  # the rule chooses a split only where both signals have a share
        with_held("coverage", m0)
    fold = np.isin(seq_of, np.unique(seq_of)[1::2])  # sequences alternate between the two folds
    fold_ms = []
    if fold.any() and (~fold).any():
        scored, covered = np.empty(len(curves)), np.empty(len(curves))
        for held in (fold, ~fold):
            m_fold = best_m(curves[~held].mean(axis=0))[0]
            fold_ms.append(m_fold)
            scored[held] = curves[held, m_fold]
            if "coverage" in means:
                covered[held] = coverage_arr(m_fold, held)
        means["best_fixed_crossval"] = float(scored.mean())
        if "coverage" in means:
            means["coverage_crossval"] = float(covered.mean())
    if length_m is not None:
        if not 0 <= int(length_m) <= free:
            raise ValueError(f"length_m={length_m} must lie in 0..k - s - w = {free}")
        means["length_m"] = float(curves[:, int(length_m)].mean())
        if 0 < m0 < free:
            with_held("coverage_length_m", int(length_m))
    gap = means["oracle"] - means["fixed"]
    return {"k": k, "m": m0, "m_candidates": list(cands), "rounds": len(best_ms),
            "sequences": int(len(np.unique(records.sequence))), "arr": means,
            "gap_closed": {name: (means[name] - means["fixed"]) / gap if gap > 0 and name in means else None
                           for name in ("persistence", "signal_proxy", "hindsight", "best_fixed",
                                        "best_fixed_crossval", "coverage", "coverage_crossval", "length_m",
                                        "coverage_length_m")
                           + tuple(f"{base}_held{r}" for base in ("coverage", "coverage_length_m") for r in hold)
                           if name in means or name in STUDY_ALWAYS},
            "best_fixed_m": {"all": m_best, "folds": fold_ms},
            **({"length_m": int(length_m)} if length_m is not None else {}),
            "oracle_m": {"mean": float(np.mean(best_ms)), "std": float(np.std(best_ms)),
                         "min": int(np.min(best_ms)), "max": int(np.max(best_ms))}}


#: the gap-closed entries :func:`m_choice_study` always reports (None where not defined); the per-length ones
#: only when given ``length_m``
STUDY_ALWAYS = ("persistence", "signal_proxy", "hindsight", "best_fixed", "best_fixed_crossval", "coverage",
                "coverage_crossval")


def best_m(arr_by_m: Sequence[float]) -> Tuple[int, float]:
    """``(m, ARR)`` maximising the ARR curve (ties: the smallest m)."""
    curve = np.asarray(arr_by_m, np.float64)
    index = int(np.argmax(curve))
    return index, float(curve[index])


# ---------------------------------------------------------------------------- Algorithm 1
@dataclasses.dataclass
class SearchResult:
    config: DustinConfig
    arr: float  # ARR of the chosen config on the calibration records
    target_layer_arr: List[float]  # (a): target-only ARR per target layer
    steps: List[dict]  # (b): per greedy step the candidates' ARR and the choice
    m_curve: List[float]  # (c): ARR for m = 0 .. k - s - w

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "arr": self.arr,
                "target_layer_arr": [None if math.isnan(x) else x for x in self.target_layer_arr],
                "steps": self.steps, "m_curve": [round(float(x), 6) for x in self.m_curve]}


def algorithm1(records: CalibrationRecords, budget: int, *, sinks: int = 4, window: Optional[int] = None,
               max_draft_layers: int = 4, min_gain: float = 0.001, draft_layers: Optional[Sequence[int]] = None,
               target_layers: Optional[Sequence[int]] = None, layer_search_m: Optional[int] = None) -> SearchResult:
    """Greedy target layer, greedy draft layers, exhaustive m (see the module doc).

    ``draft_layers``: the model layer ids of ``records.draft_scores`` rows (default 0..L_D-1);
    ``target_layers``: which target layers to consider (default all); ``min_gain`` in ARR units
    (0.001 = 0.1 percentage points); ``layer_search_m``: the m at which step (b) compares draft
    layer sets (``None``, the default: each set at its best m).
    """
    check_budget(budget)
    window = default_window(budget) if window is None else window
    free = budget - sinks - window
    if free < 0:
        raise ValueError(f"sinks={sinks} + window={window} exceed the budget k={budget}")
    draft_ids = list(range(records.draft_scores.shape[0])) if draft_layers is None else [int(x) for x in draft_layers]
    candidates_t = list(range(records.target_scores.shape[0])) if target_layers is None else list(target_layers)
    common = dict(k=budget, sinks=sinks, window=window)
    # (a) target layer
    per_layer = [selection_arr(records.weights, None, records.target_scores[layer], records.lengths, m=0, **common)
                 if layer in candidates_t else float("nan") for layer in range(records.target_scores.shape[0])]
    target_layer = int(np.nanargmax(per_layer))
    s_target = records.target_scores[target_layer]
    current, chosen, steps = per_layer[target_layer], [], []
    curve = np.full(free + 1, current)
    # (b) draft layers
    while len(chosen) < max_draft_layers:
        trials = {}
        for index in range(len(draft_ids)):
            if index in chosen:
                continue
            s_draft = records.draft_scores[chosen + [index]].sum(axis=0)
            arr_curve = sweep_m(records.weights, s_draft, s_target, records.lengths, **common)
            score = best_m(arr_curve)[1] if layer_search_m is None else float(arr_curve[min(layer_search_m, free)])
            trials[index] = (score, arr_curve)
        if not trials:
            break
        pick = max(trials, key=lambda i: (trials[i][0], -i))
        gain = trials[pick][0] - current
        steps.append({"candidates": {str(draft_ids[i]): round(v[0], 6) for i, v in trials.items()},
                      "best": draft_ids[pick], "gain": gain, "added": gain >= min_gain})
        if gain < min_gain:
            break
        chosen.append(pick)
        current, curve = trials[pick]
    # (c) m
    m, arr = best_m(curve) if chosen else (0, current)
    config = DustinConfig(budget=budget, sinks=sinks, window=window, m=m, target_layer=target_layer,
                          target_heads=records.target_heads[target_layer],
                          draft_layers=tuple(draft_ids[i] for i in chosen),
                          draft_heads=tuple(records.draft_heads[i] for i in chosen), mode="hybrid")
    return SearchResult(config=config, arr=float(arr), target_layer_arr=[float(x) for x in per_layer], steps=steps,
                        m_curve=[float(x) for x in curve])


# ---------------------------------------------------------------------------- profile
@dataclasses.dataclass
class DustinProfile:
    """The result of profiling one target–draft pair: a config per budget and its provenance."""

    configs: Dict[int, DustinConfig]
    target: Dict[str, Any]  # name, source, shape
    draft: Dict[str, Any]
    data: Dict[str, Any]  # calibration data description (split, task ids, source, fingerprints)
    created: str  # ISO 8601 UTC
    gamma: int = 4
    srh: Dict[str, Any] = dataclasses.field(default_factory=dict)
    search: Dict[str, Any] = dataclasses.field(default_factory=dict)  # per budget: SearchResult.to_dict()
    #: per budget, the split m recalibrated at further context lengths with the budget's layers kept
    #: (:func:`recalibrate_m`, docs/methods.md §3.7): ``{budget: {context tokens: m}}``; empty: one m per budget
    m_by_length: Dict[int, Dict[int, int]] = dataclasses.field(default_factory=dict)

    def config(self, budget: int, mode: str = "hybrid", context: Optional[int] = None) -> DustinConfig:
        """The profiled config for ``budget`` (``mode``: hybrid / target / draft ablation). ``context``
        (tokens of history): Dustin-H's m from the per-length table at that length (:meth:`m_at`), where
        the profile has one for ``budget``; the profiled m otherwise."""
        check_budget(budget)
        if budget not in self.configs:
            raise ProfileError(f"this profile has no config for k={budget}; profiled budgets: {sorted(self.configs)}")
        config = self.configs[budget].replace(mode=mode) if mode != "hybrid" else self.configs[budget]
        if context is not None and mode == "hybrid" and self.m_by_length.get(budget):
            config = config.replace(m=self.m_at(budget, context))
        return config

    def m_at(self, budget: int, context: int) -> int:
        """The split m for ``budget`` at ``context`` tokens: the per-length table (:attr:`m_by_length`)
        interpolated linearly in log length between the two calibrated lengths around ``context``, and
        held at the nearest end outside them; the profiled m where the table has no entry for ``budget``."""
        if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 1:
            raise ProfileError(f"context={context!r}: give the history length in tokens (an integer >= 1)")
        if budget not in self.configs:
            raise ProfileError(f"this profile has no config for k={budget}; profiled budgets: {sorted(self.configs)}")
        table = self.m_by_length.get(budget)
        if not table:
            return self.configs[budget].effective_m
        lengths = sorted(table)
        if context <= lengths[0]:
            return int(table[lengths[0]])
        if context >= lengths[-1]:
            return int(table[lengths[-1]])
        upper = next(i for i, n in enumerate(lengths) if n >= context)
        lo, hi = lengths[upper - 1], lengths[upper]
        t = (math.log(context) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return int(round(table[lo] + t * (table[hi] - table[lo])))

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "kind": "jaxspec.dustin.profile", "created": self.created,
                "target": self.target, "draft": self.draft, "data": self.data, "gamma": self.gamma,
                "configs": {str(k): c.to_dict() for k, c in sorted(self.configs.items())},
                "srh": self.srh, "search": self.search,
                **({"m_by_length": {str(b): {str(n): int(m) for n, m in sorted(t.items())}
                                    for b, t in sorted(self.m_by_length.items())}} if self.m_by_length else {})}

    def save(self, path) -> None:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def from_dict(cls, data, where: str = "profile") -> "DustinProfile":
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: not a Dustin profile (a JSON object is expected, got {type(data).__name__})")
        if data.get("kind") != "jaxspec.dustin.profile":
            raise ProfileError(f"{where}: not a Dustin profile (kind={data.get('kind')!r})")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{where}: profile format {data.get('format')!r} is not supported "
                               f"(this code reads format {PROFILE_FORMAT})")
        missing = [key for key in ("created", "target", "draft", "data", "configs") if key not in data]
        if missing:
            raise ProfileError(f"{where}: the profile lacks {missing}")
        if not isinstance(data["configs"], dict) or not data["configs"]:
            raise ProfileError(f"{where}: 'configs' must map budgets to configs")
        configs = {}
        for key, value in data["configs"].items():
            try:
                budget = int(key)
            except ValueError:
                raise ProfileError(f"{where}: budget key {key!r} is not an integer") from None
            if budget not in SUPPORTED_BUDGETS:
                raise ProfileError(f"{where}: budget {budget} is not supported (one of "
                                   f"{', '.join(map(str, SUPPORTED_BUDGETS))})")
            try:
                config = DustinConfig.from_dict(value)
            except (ValueError, TypeError) as error:
                raise ProfileError(f"{where}: bad config for k={budget}: {error}") from error
            if config.budget != budget:
                raise ProfileError(f"{where}: the config under k={budget} has budget {config.budget}")
            configs[budget] = config
        for key in ("target", "draft", "data"):
            if not isinstance(data[key], dict):
                raise ProfileError(f"{where}: {key!r} must be an object")
        return cls(configs=configs, target=data["target"], draft=data["draft"], data=data["data"],
                   created=str(data["created"]), gamma=int(data.get("gamma", 4)), srh=data.get("srh", {}),
                   search=data.get("search", {}), m_by_length=_m_by_length_from(data.get("m_by_length", {}),
                                                                                configs, where))

    @classmethod
    def load(cls, path) -> "DustinProfile":
        path = pathlib.Path(path)
        if not path.is_file():
            raise ProfileError(f"Dustin profile {str(path)!r} does not exist")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ProfileError(f"{path}: corrupt Dustin profile (not valid JSON: {error})") from error
        return cls.from_dict(data, where=str(path))

    def check_models(self, target_config: ModelConfig, draft_config: Optional[ModelConfig] = None) -> None:
        """Raise :class:`ProfileError` if the models do not match the profiled shapes."""
        for what, info, config in (("target", self.target, target_config), ("draft", self.draft, draft_config)):
            if config is None:
                continue
            given = {"num_layers": config.num_layers, "num_heads": config.num_heads,
                     "num_kv_heads": config.num_kv_heads}
            for field, value in given.items():
                if field in info and info[field] != value:
                    raise ProfileError(f"the profile's {what} has {field}={info[field]}, the given model "
                                       f"{value}: profile {info.get('name')!r} is for another model")


def _m_by_length_from(data, configs: Dict[int, DustinConfig], where: str) -> Dict[int, Dict[int, int]]:
    """A profile's ``m_by_length`` object, checked: budgets it has configs for, lengths >= 1, each m within
    that budget's ``0 .. k - s - w``."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: 'm_by_length' must map budgets to {{context tokens: m}}")
    out: Dict[int, Dict[int, int]] = {}
    for budget_key, table in data.items():
        try:
            budget = int(budget_key)
        except ValueError:
            raise ProfileError(f"{where}: m_by_length budget key {budget_key!r} is not an integer") from None
        if budget not in configs:
            raise ProfileError(f"{where}: m_by_length has k={budget}, which has no config (profiled: {sorted(configs)})")
        if not isinstance(table, dict) or not table:
            raise ProfileError(f"{where}: m_by_length[{budget_key!r}] must map context lengths to m")
        free = configs[budget].free_budget
        out[budget] = {}
        for length_key, m in table.items():
            try:
                length = int(length_key)
            except ValueError:
                raise ProfileError(f"{where}: m_by_length[{budget_key!r}] length key {length_key!r} is not an "
                                   f"integer") from None
            if length < 1 or isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= free:
                raise ProfileError(f"{where}: m_by_length[{budget_key!r}][{length_key!r}] = {m!r}: lengths must be "
                                   f">= 1 and m in 0..k - s - w = {free}")
            out[budget][length] = m
    return out


def model_info(config: ModelConfig, name: str = "", source: str = "") -> dict:
    return {"name": name or config.name, "source": source, "num_layers": config.num_layers,
            "num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "model_type": config.model_type}


def check_calibration_data(calibration, evaluation=None) -> None:
    """Calibration tasks must come from the calibration split and share nothing with evaluation."""
    bad = [t.task_id for t in calibration if t.split != "calibration"]
    if bad:
        raise ValueError(f"calibration tasks must come from the calibration split (jaxspec.data.build_splits); "
                         f"{len(bad)} do not, e.g. {bad[:3]}")
    if evaluation is not None:
        shared_prompts = {t.prompt for t in calibration} & {t.prompt for t in evaluation}
        shared_seeds = {t.seed for t in calibration} & {t.seed for t in evaluation}
        shared_hay = ({t.haystack_sha256 for t in calibration if t.haystack_sha256}
                      & {t.haystack_sha256 for t in evaluation if t.haystack_sha256})
        if shared_prompts or shared_seeds or shared_hay:
            raise ValueError("calibration and evaluation data overlap (prompts, seeds or haystack)")


def profile_pair(target_params, target_config: ModelConfig, draft_params, draft_config: Optional[ModelConfig],
                 calibration,
                 tokenizer, *, budgets: Sequence[int] = (512,), evaluation=None, target_name: str = "",
                 target_source: str = "", draft_name: str = "", draft_source: str = "", prefix_ids: Sequence[int] = (),
                 gamma: int = 4, max_new_tokens: int = 32, heads_per_layer: int = 4, recall_threshold: float = 0.5,
                 srh_max_new_tokens: Optional[int] = None, batch_size: int = 4, sinks: int = 4,
                 max_draft_layers: int = 4, min_gain: float = 0.001, layer_search_m: Optional[int] = None,
                 self_draft_mask=None, srh_kv_groups: Optional[int] = None) -> Tuple[DustinProfile, CalibrationRecords]:
    """SRHs of both models on the calibration needle tasks, calibration rounds on the same prompts,
    Algorithm 1 per budget. Returns the profile and the records (for further sweeps).

    A self-draft: ``draft_params=None``, ``draft_config=None`` and ``self_draft_mask`` ``[L, 2]``.
    ``srh_kv_groups``: each layer's SRHs (target and draft) come from at most that many KV groups
    (``SRHResult.top_heads(kv_groups=...)``, docs/methods.md §3.4); None: the best heads anywhere."""
    from jaxspec.dustin.srh import cases_from_tasks, check_kv_groups, identify_srh

    for budget in budgets:
        check_budget(budget)
    if srh_kv_groups is not None:  # before any forward
        for model in (target_config, draft_config or target_config):
            check_kv_groups(srh_kv_groups, model.queries_per_kv, model.num_heads, min(heads_per_layer, model.num_heads))
    tasks = list(calibration)
    check_calibration_data(tasks, evaluation)
    cases = cases_from_tasks(tasks, tokenizer, prefix_ids=prefix_ids)
    srh_t = identify_srh(target_params, target_config, cases, max_new_tokens=srh_max_new_tokens,
                         recall_threshold=recall_threshold, batch_size=batch_size)
    if draft_config is None:  # self-draft: the target with the mask's sub-layers skipped
        if self_draft_mask is None:
            raise ValueError("a self-draft profile needs self_draft_mask (draft_config=None)")
        srh_d = identify_srh(target_params, target_config, cases, max_new_tokens=srh_max_new_tokens,
                             recall_threshold=recall_threshold, batch_size=batch_size, skip_mask=self_draft_mask)
    else:
        srh_d = identify_srh(draft_params, draft_config, cases, max_new_tokens=srh_max_new_tokens,
                             recall_threshold=recall_threshold, batch_size=batch_size)
    draft_model = draft_config or target_config
    target_heads = srh_t.top_heads(heads_per_layer, kv_groups=srh_kv_groups, queries_per_kv=target_config.queries_per_kv)
    draft_heads = srh_d.top_heads(heads_per_layer, kv_groups=srh_kv_groups, queries_per_kv=draft_model.queries_per_kv)
    records = collect_calibration(target_params, target_config, draft_params, draft_config,
                                  [c.tokens for c in cases], target_heads=target_heads, draft_heads=draft_heads,
                                  gamma=gamma, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                  self_draft_mask=self_draft_mask)
    results = {b: algorithm1(records, b, sinks=sinks, max_draft_layers=max_draft_layers, min_gain=min_gain,
                             layer_search_m=layer_search_m) for b in budgets}
    data = _calibration_data(tasks, records, max_new_tokens, evaluation)
    profile = DustinProfile(
        configs={b: r.config for b, r in results.items()},
        target=model_info(target_config, target_name, target_source),
        draft=(model_info(draft_config, draft_name, draft_source) if draft_config is not None else
               {**model_info(target_config, draft_name or f"{target_config.name} (self-draft)", target_source),
                "self_draft_mask": np.asarray(self_draft_mask, bool).astype(int).tolist()}), data=data,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), gamma=gamma,
        srh={"target": {"top_heads": [list(h) for h in target_heads], **srh_t.to_dict()},
             "draft": {"top_heads": [list(h) for h in draft_heads], **srh_d.to_dict()},
             "recall_threshold": recall_threshold, "heads_per_layer": heads_per_layer,
             **({"kv_groups": srh_kv_groups} if srh_kv_groups is not None else {})},
        search={str(b): r.to_dict() for b, r in results.items()})
    return profile, records


def _calibration_data(tasks, records: CalibrationRecords, max_new_tokens: int, evaluation) -> dict:
    return {"split": "calibration", "num_tasks": len(tasks), "task_ids": [t.task_id for t in tasks],
            "sources": sorted({t.source for t in tasks}),
            "haystack_sha256": sorted({t.haystack_sha256 for t in tasks if t.haystack_sha256}),
            "context_tokens": sorted({t.context_tokens for t in tasks}), "rounds_items": records.num_items,
            "max_new_tokens": max_new_tokens, "disjoint_from_evaluation_checked": evaluation is not None}


def extend_profile(profile: DustinProfile, target_params, target_config: ModelConfig, draft_params,
                   draft_config: Optional[ModelConfig], calibration, tokenizer, *, budgets: Sequence[int],
                   evaluation=None, prefix_ids: Sequence[int] = (), max_new_tokens: int = 32, batch_size: int = 4,
                   sinks: int = 4, max_draft_layers: int = 4, min_gain: float = 0.001,
                   layer_search_m: Optional[int] = None, self_draft_mask=None) -> Tuple[DustinProfile, CalibrationRecords]:
    """``profile`` with configs for further ``budgets``: the profile's own SRHs (no new
    identification), calibration rounds on ``calibration`` -- typically longer prompts, where a
    larger k is still sparse -- and Algorithm 1 per new budget (docs/methods.md §3.4). The existing
    configs are kept as they are; ``data["extensions"]`` records each extension's calibration data,
    and the haystack fingerprints are merged (the evaluation-overlap checks see every part used)."""
    budgets = sorted({check_budget(b) for b in budgets})
    present = [b for b in budgets if b in profile.configs]
    if present:
        raise ProfileError(f"the profile already has k={present}; extend it with other budgets "
                           f"(profiled: {sorted(profile.configs)})")
    if "target" not in profile.srh or "draft" not in profile.srh:
        raise ProfileError("the profile records no SRHs (srh.target / srh.draft top_heads): profile the pair anew")
    from jaxspec.dustin.srh import cases_from_tasks

    profile.check_models(target_config, draft_config)
    tasks = list(calibration)
    check_calibration_data(tasks, evaluation)
    cases = cases_from_tasks(tasks, tokenizer, prefix_ids=prefix_ids)
    target_heads = profile.srh["target"]["top_heads"]
    draft_heads = profile.srh["draft"]["top_heads"]
    records = collect_calibration(target_params, target_config, draft_params, draft_config,
                                  [c.tokens for c in cases], target_heads=target_heads, draft_heads=draft_heads,
                                  gamma=profile.gamma, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                  self_draft_mask=self_draft_mask)
    results = {b: algorithm1(records, b, sinks=sinks, max_draft_layers=max_draft_layers, min_gain=min_gain,
                             layer_search_m=layer_search_m) for b in budgets}
    extension = {"budgets": budgets, **_calibration_data(tasks, records, max_new_tokens, evaluation),
                 "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    data = dict(profile.data)
    data["haystack_sha256"] = sorted(set(data.get("haystack_sha256", [])) | set(extension["haystack_sha256"]))
    data["extensions"] = list(data.get("extensions", [])) + [extension]
    extended = dataclasses.replace(
        profile, configs={**profile.configs, **{b: r.config for b, r in results.items()}},
        search={**profile.search, **{str(b): r.to_dict() for b, r in results.items()}}, data=data)
    return extended, records


# ---------------------------------------------------------------------------- m per context length
def profile_signal_layers(profile: DustinProfile, budgets: Sequence[int]
                          ) -> Tuple[List[int], List[Tuple[int, ...]], List[Tuple[int, ...]]]:
    """``(draft layers, their heads, target heads per target layer)`` that the Dustin-H configs of ``budgets``
    read: the union of their draft SRH layers (sorted) with each one's heads and, per target layer, the heads
    any of them probes there (``(0,)`` where none does). Raises :class:`ProfileError` where two budgets read a layer with other heads."""
    draft: Dict[int, Tuple[int, ...]] = {}
    target: Dict[int, Tuple[int, ...]] = {}
    for budget in budgets:
        config = profile.config(budget)
        pairs = [(draft, layer, tuple(hs)) for layer, hs in zip(config.draft_layers, config.draft_heads)]
        for table, layer, heads in pairs + [(target, config.target_layer, tuple(config.target_heads))]:
            if table.setdefault(layer, heads) != heads:
                raise ProfileError(f"the profile's budgets {list(budgets)} read layer {layer} with different SRH "
                                   f"heads; recalibrate them separately")
    layers = sorted(draft)
    num_layers = int(profile.target.get("num_layers", max(target) + 1))
    return layers, [draft[layer] for layer in layers], [target.get(layer, (0,)) for layer in range(num_layers)]


def profiled_length(profile: DustinProfile, budget: int) -> Optional[int]:
    """The context length of the calibration tasks Algorithm 1 chose ``budget``'s config on (the profile's own, or
    the extension that added the budget); None where those tasks had several lengths or none is recorded."""
    lengths = profile.data.get("context_tokens")
    for extension in profile.data.get("extensions", []):
        if budget in extension.get("budgets", []):
            lengths = extension.get("context_tokens")
    return int(lengths[0]) if isinstance(lengths, list) and len(lengths) == 1 else None


def m_at_length(records: CalibrationRecords, config: DustinConfig, *, draft_rows: Sequence[int],
                target_layer: Optional[int] = None) -> Dict[str, Any]:
    """Step (c) of Algorithm 1 alone (docs/methods.md §3.7): with ``config``'s SRH layers kept, the m whose
    hybrid selection has the best mean ARR on ``records`` (:func:`sweep_m`, ties: the smallest m), its ARR,
    the ARR at ``config``'s own m, and the whole curve. ``draft_rows``: the rows of ``records.draft_scores``
    holding ``config.draft_layers``; ``target_layer``: the row of ``records.target_scores`` (default the
    config's target layer)."""
    if not config.draft_layers or not config.target_heads:
        raise ValueError(f"k={config.budget}: the config has no draft layer (or no target head), so there is no "
                         f"split m to calibrate")
    layer = config.target_layer if target_layer is None else target_layer
    curve = sweep_m(records.weights, records.draft_scores[list(draft_rows)].sum(axis=0),
                    records.target_scores[layer], records.lengths, k=config.budget, sinks=config.sinks,
                    window=config.window_size)
    m, arr = best_m(curve)
    return {"m": m, "arr": arr, "profile_m": config.effective_m, "arr_at_profile_m": float(curve[config.effective_m]),
            "rounds": records.num_items, "m_curve": [round(float(x), 6) for x in curve]}


def check_recalibration(profile: DustinProfile, budgets: Optional[Sequence[int]] = None) -> List[int]:
    """The sorted budgets :func:`recalibrate_m` would recalibrate (default: every profiled one); raises
    :class:`ProfileError` for a budget the profile lacks or whose config has no split (no draft layer), before any
    model work."""
    budgets = sorted(profile.configs) if budgets is None else sorted({check_budget(b) for b in budgets})
    missing = [b for b in budgets if b not in profile.configs]
    if missing:
        raise ProfileError(f"the profile has no config for k={missing}; profiled: {sorted(profile.configs)}")
    no_split = [b for b in budgets if not (profile.configs[b].draft_layers and profile.configs[b].target_heads)]
    if no_split:
        raise ProfileError(f"k={no_split}: the profile's config has no draft layer, so there is no split m to "
                           f"recalibrate; leave these budgets out")
    return budgets


def recalibrate_m(profile: DustinProfile, target_params, target_config: ModelConfig, draft_params,
                  draft_config: Optional[ModelConfig], calibration, tokenizer, *, budgets: Optional[Sequence[int]] = None,
                  evaluation=None, prefix_ids: Sequence[int] = (), max_new_tokens: int = 32, batch_size: int = 4,
                  self_draft_mask=None) -> Tuple[DustinProfile, Dict[int, CalibrationRecords]]:
    """``profile`` with its split m recalibrated at each context length of ``calibration`` (docs/methods.md §3.7):
    per length, calibration rounds (full-KV greedy SD, as :func:`collect_calibration`) on that length's tasks with
    the profile's own SRH layers and heads, then step (c) of Algorithm 1 per budget (:func:`m_at_length`); the
    layers stay as profiled. The result's :attr:`DustinProfile.m_by_length` holds each (budget, length)'s m
    (merged over earlier recalibrations; a length calibrated again is replaced), ``search[k]["m_by_length"]``
    each one's ARR curve, and ``data["m_recalibrations"]`` the calibration data used."""
    budgets = check_recalibration(profile, budgets)
    from jaxspec.dustin.srh import cases_from_tasks

    profile.check_models(target_config, draft_config)
    tasks = list(calibration)
    if not tasks:
        raise ValueError("recalibrate_m needs calibration tasks (one or more context lengths)")
    check_calibration_data(tasks, evaluation)
    draft_layers, draft_heads, target_heads = profile_signal_layers(profile, budgets)
    if len(target_heads) != target_config.num_layers:
        raise ProfileError(f"the profile's target has {len(target_heads)} layers; the given one "
                           f"{target_config.num_layers}")
    table = {b: dict(profile.m_by_length.get(b, {})) for b in profile.m_by_length}
    profiled_at = {}  # a budget's first table also holds its profiled m at the length Algorithm 1 calibrated it
    for budget in budgets:
        length = profiled_length(profile, budget)
        if not table.get(budget) and length is not None:
            table[budget] = {length: profile.configs[budget].effective_m}
            profiled_at[str(budget)] = length
    search = {key: dict(value) for key, value in profile.search.items()}
    records_by_length: Dict[int, CalibrationRecords] = {}
    extensions = []
    for length in sorted({t.context_tokens for t in tasks}):
        part = [t for t in tasks if t.context_tokens == length]
        cases = cases_from_tasks(part, tokenizer, prefix_ids=prefix_ids)
        records = collect_calibration(target_params, target_config, draft_params, draft_config,
                                      [c.tokens for c in cases], target_heads=target_heads,
                                      draft_heads=draft_heads, draft_layers=draft_layers, gamma=profile.gamma,
                                      max_new_tokens=max_new_tokens, batch_size=batch_size,
                                      self_draft_mask=self_draft_mask)
        records_by_length[length] = records
        for budget in budgets:
            config = profile.configs[budget]
            found = m_at_length(records, config, draft_rows=[draft_layers.index(x) for x in config.draft_layers])
            table.setdefault(budget, {})[length] = found["m"]
            entry = dict(search.get(str(budget), {}))
            entry["m_by_length"] = {**entry.get("m_by_length", {}), str(length): found}
            search[str(budget)] = entry
        extensions.append(_calibration_data(part, records, max_new_tokens, evaluation))
    data = dict(profile.data)
    data["haystack_sha256"] = sorted(set(data.get("haystack_sha256", []))
                                     | {h for e in extensions for h in e["haystack_sha256"]})
    data["m_recalibrations"] = list(data.get("m_recalibrations", [])) + [
        {"budgets": budgets, "lengths": sorted(records_by_length), "parts": extensions,
         **({"profiled_m_at": profiled_at} if profiled_at else {}),
         "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}]
    return dataclasses.replace(profile, m_by_length=table, search=search, data=data), records_by_length

