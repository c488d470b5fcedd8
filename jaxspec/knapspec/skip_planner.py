"""One KnapSpec plan: :func:`plan_skip_set` (reference states, the DP, the grid search, rescoring the
finalists), the :class:`KnapSpecPlanner` the controller calls, its price and the planning allowance
(docs/methods.md §5), and the :class:`PlanRecord` each plan leaves."""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional, Tuple

import jax
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.knapspec.config import KnapSpecConfig, dp_history_backend, exit_threshold
from jaxspec.knapspec.coupled import plan_coupled_skip_set
from jaxspec.knapspec.dp import Candidates, boundary_states, knapsack_dp, knapsack_weights, plan_agreement, skip_budget
from jaxspec.knapspec.latency import LatencyModel
from jaxspec.knapspec.planner import Plan, PlannerBase, choose_plan


@dataclasses.dataclass
class PlanRecord:
    round: int
    plan: Plan
    candidates: Optional[Candidates]
    reference_tokens: int  # total over rows
    weights: Tuple[int, int]
    seconds: float
    gamma_used: int = -1  # tokens drafted per round under this plan (0 = plain decoding)
    verify_rows: int = 0  # rows per verification (engine gamma + 1; 1 = plain decoding)
    context_length: float = 0.0  # mean committed tokens per row when planning
    planner: str = "knapspec"
    probe: Optional[dict] = None  # the measured arbitration after this plan (KnapSpecConfig.probe_rounds)
    predicted_seconds: Optional[float] = None  # the planner's reference_cost x the window width (None: no model)
    rows: Optional[int] = None  # the rows the DP ran on (KnapSpecConfig.plan_rows; None: not recorded)
    # the controller's parts of the plan (seconds): waiting for the device work in flight when it began,
    # the reference window (and the planning rows' cache), applying the plan; None: not recorded
    host_seconds: Optional[Dict[str, float]] = None
    states_from_prefill: bool = False  # the window's target states came from the prefill (prefill_window)
    states_from_plain: bool = False  # ... from the plain stretch that decoded the window (Chunk keep_states)

    def summary(self) -> dict:
        out = self.plan.summary()
        mask = np.asarray(self.plan.mask, bool)
        out.update(round=self.round, reference_tokens=self.reference_tokens, w_attn=self.weights[0],
                   w_mlp=self.weights[1], candidates=len(self.candidates) if self.candidates is not None else 0,
                   seconds=self.seconds, planner=self.planner, gamma_star=int(self.plan.gamma),
                   gamma_used=int(self.gamma_used), mode="ar" if self.gamma_used == 0 else "speculative",
                   verify_rows=int(self.verify_rows), context_length=float(self.context_length),
                   n_skip_attn=int(mask[:, 0].sum()), n_skip_mlp=int(mask[:, 1].sum()), probe=self.probe,
                   predicted_seconds=self.predicted_seconds, rows=self.rows,
                   states_from_prefill=self.states_from_prefill, states_from_plain=self.states_from_plain)
        c = self.candidates
        if c is not None and c.stage_seconds:  # with the controller's parts, and the rest of the planning time
            stages = dict(c.stage_seconds, **(self.host_seconds or {}))
            out["stage_seconds"] = dict(stages, other=self.seconds - sum(stages.values()))
            out["dp_attention"] = c.history_backend or "xla"
        if c is not None and c.search_alpha is not None:  # a two-stage plan: the search's estimate beside the window's
            out.update(search_tokens=c.search_tokens, search_alpha=float(c.search_alpha[self.plan.index]),
                       rescore=c.rescore)
        return out


#: work inside each annotated span)
PLAN_ANNOTATION = "jaxspec.knapspec.plan"


def plan_skip_set(target_params, config: ModelConfig, cache, tokens, token_mask, prefix_len, latency: LatencyModel,
                  n: float, knapspec: KnapSpecConfig = KnapSpecConfig(),
                  states: Optional[jax.Array] = None) -> Tuple[Plan, Candidates, Tuple[int, int]]:
    """Stage 1 (DP) and stage 2 (grid search) on one reference window. ``states``: the target's residual
    stream of the window (:func:`~jaxspec.knapspec.dp.boundary_states`) when already known (kept from the
    prefill: :func:`prefill_window`); its stage then costs nothing and is recorded as 0."""
    t_attn, t_mlp = latency.t_attn(n), latency.t_mlp()
    w_attn, w_mlp = knapsack_weights(t_attn, t_mlp, knapspec.weight_cap)
    clock = [time.perf_counter()]
    stages = {}

    def lap(name, value=None):  # wall seconds of each part of the plan (the parts run one after another anyway)
        if value is not None:
            jax.block_until_ready(value)
        now = time.perf_counter()
        stages[name] = stages.get(name, 0.0) + now - clock[0]
        clock[0] = now

    with jax.profiler.TraceAnnotation(f"{PLAN_ANNOTATION}.boundary_states"):
        if states is None:
            states = boundary_states(target_params, config, tokens, cache, prefix_len)
        lap("boundary_states", states)
    threshold = exit_threshold(knapspec)
    search = knapspec.search_tokens
    two_stage = search is not None and int(search) < tokens.shape[1]
    s = int(search) if two_stage else tokens.shape[1]  # the window's first s tokens: same prefix, causal
    mask = None if token_mask is None else np.asarray(token_mask)[:, :s]
    with jax.profiler.TraceAnnotation(f"{PLAN_ANNOTATION}.dp"):
        candidates = knapsack_dp(target_params, config, cache, prefix_len, states[:, :, :s], mask, w_attn=w_attn,
                                 w_mlp=w_mlp, tau=knapspec.tau, branch_chunk=knapspec.branch_chunk,
                                 exit_threshold=threshold, keep_attention=knapspec.keep_attention,
                                 reference_kv=knapspec.reference_kv, history_backend=dp_history_backend(knapspec),
                                 segments=knapspec.dp_segments, layers=knapspec.dp_layers)
        lap("dp")

    def choose(c):
        return choose_plan(c.masks, c.alpha, latency, n, gammas=knapspec.plan_gammas, objective=knapspec.objective,
                           exclude_full=knapspec.exclude_full,
                           exit_stats=None if threshold is None else (c.confident, c.agree_confident))

    plan = choose(candidates)
    lap("grid_search")
    if two_stage:
        with jax.profiler.TraceAnnotation(f"{PLAN_ANNOTATION}.rescore"):
            candidates = rescore_finalists(candidates, plan.table, knapspec.finalists, target_params, config, cache,
                                           prefix_len, states, token_mask, threshold, knapspec.reference_kv, s,
                                           executed_only=knapspec.rescore == "executed")
            lap("rescore")
        plan = choose(candidates)
        lap("grid_search")
    return plan, dataclasses.replace(candidates, stage_seconds=stages), (w_attn, w_mlp)


def rescore_finalists(candidates: Candidates, table: np.ndarray, finalists: int, target_params, config, cache,
                      prefix_len, states, token_mask, threshold, reference_kv: str, search_tokens: int,
                      executed_only: bool = True) -> Candidates:
    """The second stage of a two-stage plan: the ``finalists`` candidates whose best grid score on the
    search tokens is highest (ties: lower index, i.e. less skipped) scored again on the whole window
    (:func:`~jaxspec.knapspec.dp.plan_agreement`, with ``executed_only``: :attr:`KnapSpecConfig.rescore`).
    Returns those candidates, their statistics replaced by the whole window's; ``search_alpha`` keeps the
    search's estimate and ``search_tokens`` its width."""
    best = np.max(np.where(np.isfinite(table), table, -np.inf), axis=1)
    order = sorted(range(len(best)), key=lambda i: (-best[i], i))
    keep = sorted(i for i in order[:finalists] if np.isfinite(best[i])) or [order[0]]
    padded = keep + [keep[0]] * (finalists - len(keep))  # always `finalists` masks: one compiled shape
    stats = plan_agreement(target_params, config, cache, prefix_len, states, candidates.masks[padded], token_mask,
                           reference_kv=reference_kv, exit_threshold=threshold,
                           executed_only=executed_only)[: len(keep)]
    exits = candidates.confident is not None
    return dataclasses.replace(
        candidates, masks=candidates.masks[keep], weights=candidates.weights[keep], cosine=candidates.cosine[keep],
        alpha=stats[:, 0], confident=stats[:, 1] if exits else None, agree_confident=stats[:, 2] if exits else None,
        final_states=None, search_alpha=candidates.alpha[keep], search_tokens=int(search_tokens),
        rescore="executed" if executed_only else "select")


@dataclasses.dataclass(frozen=True)
class KnapSpecPlanner(PlannerBase):
    """The KnapSpec planner: DP over sub-layers (or whole layers with ``knapspec.coupled``) and the
    (candidate, gamma) grid search under ``knapspec.objective`` (TPT, or the TPL ablation).

    A planner is a :class:`~jaxspec.knapspec.planner.Planner` (derive from
    :class:`~jaxspec.knapspec.planner.PlannerBase`)."""

    latency: LatencyModel
    knapspec: KnapSpecConfig = KnapSpecConfig()

    @property
    def name(self) -> str:
        return "knapspec" + ("-coupled" if self.knapspec.coupled else "") + (
            "" if self.knapspec.objective == "tpt" else f"-{self.knapspec.objective}")

    def latency_model(self) -> LatencyModel:
        return self.latency

    def reference_cost(self, config: ModelConfig, n: float) -> float:
        """Predicted seconds of one DP per reference token of each row: the scan runs the ``J = budget
        + 1`` slot states of every reference token through each sub-layer, i.e. ``J`` extra rows
        through the whole model (the prefix cache is shared by the slots, read once). Each row costs
        the latency model's many-row price at this context ``t_row(n) = u + u_n n`` when the profile
        measured it (every row attends to the whole context), else its
        verification-row cost ``v t_step`` (from at most 11 rows: fine on a compute-bound CPU; on a GPU, where
        a few rows cost about what one does, an extrapolation to hundreds of rows); both 0 predicts 0, i.e.
        no cap.
        Checked on the CPU with ``v``: SmolLM2-135M 3.05 s predicted vs 3.2-3.65 s measured,
        Qwen2.5-Coder-1.5B 38.6 s vs 45.5 s."""
        return float(self._slots(config, n)) * self.latency.t_extra_row(n, config.num_layers)

    def _slots(self, config: ModelConfig, n: float) -> int:
        lat = self.latency
        if self.knapspec.coupled:
            return config.num_layers // 2 + 1
        return skip_budget(*knapsack_weights(lat.t_attn(n), lat.t_mlp(), self.knapspec.weight_cap),
                           config.num_layers) + 1

    def reference_costs(self, config: ModelConfig, n: float, states_known: bool = False,
                        two_stage: Optional[bool] = None) -> Tuple[float, float]:
        """``(fixed, per_token)`` predicted seconds of one plan: with ``search_tokens`` (two-stage plan) the
        DP's ``J`` rows per search token are a fixed cost and each window token adds the finalists' rows
        plus one for the target's own states of the window (``boundary_states``; none with ``states_known``,
        states kept from the prefill; next to ``J`` rows it is left out); without it every window token costs
        the DP's ``J`` rows (:meth:`reference_cost`). The finalists' rows are an upper bound: they run only
        the sub-layers they execute after their first skip (``dp.plan_agreement``). Each separate pass -- the
        window's states (unless known), the DP, the rescoring -- adds the many-row forward's fixed part
        (``LatencyModel.t_pass``) to ``fixed``. ``two_stage``: whether the window is wider than the search
        tokens (None: assume it is)."""
        slots, row = self._slots(config, n), self.latency.t_extra_row(n, config.num_layers)
        own_states = 0 if states_known else 1
        passes = own_states + 1
        if self.knapspec.search_tokens is None or two_stage is False:
            return passes * self.latency.t_pass(n), float(slots) * row
        return (float(slots) * row * int(self.knapspec.search_tokens) + (passes + 1) * self.latency.t_pass(n),
                float(self.knapspec.finalists + own_states) * row)

    #: :meth:`plan` takes ``states=`` (the window's target states kept from the prefill; the controller passes
    #: them to a planner with this flag for a plan at the start)
    accepts_window_states = True

    def plan(self, target_params, config, cache, tokens, token_mask, prefix_len, n, states=None):
        if self.knapspec.coupled:
            return plan_coupled_skip_set(target_params, config, cache, tokens, token_mask, prefix_len, self.latency,
                                         n, self.knapspec, states=states)
        return plan_skip_set(target_params, config, cache, tokens, token_mask, prefix_len, self.latency, n,
                             self.knapspec, states=states)


def plan_price(planner, config: ModelConfig, n: float, knapspec: KnapSpecConfig, row_share: float = 1.0,
               states_known: bool = False, two_stage: Optional[bool] = None) -> Optional[Tuple[float, float]]:
    """``(fixed, per_token)`` predicted seconds of one plan as the allowance prices it (the planner's
    ``reference_costs``, else ``reference_cost`` per token and nothing fixed), scaled by ``row_share`` and
    ``plan_cost_scale``; None for a planner without a cost model. ``two_stage``: as ``reference_costs``."""
    costs = getattr(planner, "reference_costs", None)
    if costs is not None:
        priced = costs(config, n, states_known=states_known, two_stage=two_stage)
    else:
        per_token = planner.reference_cost(config, n)
        if per_token is None:
            return None
        priced = (0.0, per_token)
    scale = float(row_share) * float(knapspec.plan_cost_scale)
    return float(priced[0]) * scale, float(priced[1]) * scale


def reference_allowance(planner, latency: Optional[LatencyModel], config: ModelConfig, n: float, new_tokens: int,
                        knapspec: KnapSpecConfig, row_share: float = 1.0, states_known: bool = False) -> dict:
    """How many reference tokens per row one plan may use so that its predicted cost stays within
    ``allowance_margin`` x ``max_plan_fraction`` of the predicted plain-decoding time of the run
    (``new_tokens`` steps of ``LatencyModel.t_plain(n)``). ``{"tokens": cap or None (no cap), "skip": True when even
    ``min_reference_tokens`` would not fit, ...}``; no cap without a budget, a latency model or a
    planner with ``reference_cost`` (CLaSp). Deterministic (no timing), so a warm-up run and the
    timed run make the same choice and compile the same DP shape. ``row_share``: the share of the
    batch's rows the DP runs on (:attr:`KnapSpecConfig.plan_rows`), which scales its predicted cost.
    ``states_known``: the first plan takes its window's target states from the prefill (:func:`prefill_window`),
    so a window token costs one row less (``reference_costs``); the cap then prices that plan. With
    ``reference_floor``, a cap below the floor is raised to it when the floor's window is predicted within
    ``max_plan_fraction`` itself (``"floor_in_margin": True``): the margin is headroom above the floor, not below it."""
    out = {"tokens": knapspec.max_reference_tokens, "skip": False}
    if knapspec.max_plan_fraction is None or latency is None:
        return out
    priced = plan_price(planner, config, n, knapspec, row_share, states_known)
    if priced is None:
        return out
    fixed, per_token = priced
    scale = float(knapspec.plan_cost_scale)
    if scale != 1.0:
        out["plan_cost_scale"] = scale
    decode = float(new_tokens) * latency.t_plain(n, config.num_layers)
    budget = knapspec.max_plan_fraction * knapspec.allowance_margin * decode
    out.update(predicted_dp_s_per_token=per_token, predicted_ar_decode_s=decode, plan_budget_s=budget)
    if fixed:
        out["predicted_dp_search_s"] = fixed
    if per_token <= 0:
        return out
    allowed = int(max(budget - fixed, 0.0) // per_token)
    floor = knapspec.reference_floor
    floor_fits = floor is not None and fixed + int(floor) * per_token <= budget / knapspec.allowance_margin
    if floor is not None and allowed < int(floor) and floor_fits:
        # the floor's window fits the planning fraction itself: the margin is headroom above the floor, not below it
        allowed = int(floor)
        out["floor_in_margin"] = True
    out["allowed_tokens"] = allowed
    if allowed < knapspec.min_reference_tokens:
        out["skip"] = True
        return out
    out["tokens"] = allowed if knapspec.max_reference_tokens is None else min(allowed, knapspec.max_reference_tokens)
    return out
