"""CLaSp baseline (docs/methods.md §4.4), planned with the coupled (whole-layer) DP of
:mod:`jaxspec.knapspec.coupled` (re-exported here: :func:`coupled_knapsack_dp`,
:func:`coupled_knapsack_reference`, :func:`backtrack_coupled`, :func:`plan_coupled_skip_set`).

* :class:`ClaspPlanner` / :func:`clasp_generate` -- CLaSp (Chen et al. 2025, in-context layer
  skipping): skip exactly ``M`` whole layers, the set chosen by the coupled DP (CLaSp has no
  pruning threshold: ``tau = -inf``) and re-optimised on the schedule of
  :class:`~jaxspec.knapspec.config.KnapSpecSchedule` (every 64 rounds). ``M`` defaults by model
  size (:func:`clasp_skip_count`: 4 for ~1B and smaller, 8 for 3-8B, 10 for 14B, 20 for
  32-70B). It drafts as KnapSpec does (up to gamma_max with early exit): CLaSp has no TPT
  model, so its gamma is gamma_max, never 0. The DP reference is the same as KnapSpec's (the
  tokens committed in the last 5 rounds), so the comparison isolates the skip-set choice.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.knapspec.coupled import (backtrack_coupled, coupled_knapsack_dp, coupled_knapsack_reference,
                                      plan_coupled_skip_set, reference_states)
from jaxspec.knapspec.latency import LatencyModel
from jaxspec.knapspec.planner import Plan, PlannerBase, objective_table
from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_generate
from jaxspec.models.params import num_params

#: CLaSp's skip counts by model size: (params below, M).
CLASP_SKIP_COUNTS = ((2e9, 4), (10e9, 8), (20e9, 10), (float("inf"), 20))
NO_PRUNING = float("-inf")


def clasp_skip_count(config: ModelConfig) -> int:
    """CLaSp's fixed skip count ``M`` for the model's size, capped at the skippable layers (L - 2)."""
    params = num_params(config)
    m = next(count for limit, count in CLASP_SKIP_COUNTS if params < limit)
    return max(0, min(m, config.num_layers - 2))


@dataclasses.dataclass(frozen=True)
class ClaspPlanner(PlannerBase):
    """CLaSp: the best set of exactly ``skip_count`` whole layers by the coupled DP (no pruning);
    gamma = ``gamma`` (CLaSp drafts up to a maximum with early exit; it has no TPT model).
    ``latency`` (optional) only fills the plan's predicted TPT for the report."""

    skip_count: int
    gamma: int = 10
    latency: Optional[LatencyModel] = None
    tau: float = NO_PRUNING
    branch_chunk: Optional[int] = None
    name: str = "clasp"

    def latency_model(self) -> Optional[LatencyModel]:
        return self.latency

    def plan(self, target_params, config, cache, tokens, token_mask, prefix_len, n):
        states = reference_states(target_params, config, cache, tokens, prefix_len)
        m = max(0, min(int(self.skip_count), config.num_layers - 2))
        candidates = coupled_knapsack_dp(target_params, config, cache, prefix_len, states, token_mask, budget=m,
                                         tau=self.tau, branch_chunk=self.branch_chunk)
        # exactly M layers (always reachable without pruning); else the most skipped that survived
        index = int(np.nonzero(candidates.weights == m)[0][0]) if (candidates.weights == m).any() else \
            int(np.argmax(candidates.weights))
        mask = candidates.masks[index]
        if self.latency is not None:
            t_attn, t_mlp, t_token = self.latency.t_attn(n), self.latency.t_mlp(), self.latency.t_token(n)
            table = objective_table(mask[None], [candidates.alpha[index]], t_attn, t_mlp, (self.gamma,),
                                    t_token=t_token, verify_row_cost=self.latency.v, target_ratio=self.latency.a)
        else:
            t_attn = t_mlp = t_token = float("nan")
            table = np.full((1, 1), np.nan)
        plan = Plan(mask=mask, gamma=int(self.gamma), score=float(candidates.cosine[index]), index=index,
                    alpha=float(candidates.alpha[index]), objective="clasp-cosine", n=float(n), t_attn=float(t_attn),
                    t_mlp=float(t_mlp), table=table, gammas=(int(self.gamma),), t_token=float(t_token),
                    verify_row_cost=float(self.latency.v) if self.latency is not None else 0.0,
                    target_ratio=float(self.latency.a) if self.latency is not None else 1.0)
        return plan, candidates, (1, 1)


def clasp_generate(target_params, target_config: ModelConfig, prompts, *, skip_count: Optional[int] = None,
                   knapspec=None, latency: Optional[LatencyModel] = None, **kwargs):
    """Generate with CLaSp self-drafting: KnapSpec's driver, schedule and draft policy with the
    :class:`ClaspPlanner` (``skip_count`` default :func:`clasp_skip_count`). ``kwargs`` as
    :func:`~jaxspec.knapspec.policy.knapspec_generate`."""
    knapspec = KnapSpecConfig() if knapspec is None else knapspec
    # CLaSp always drafts: no plain-decoding fallback, so no measured arbitration (KnapSpec's probe)
    knapspec = dataclasses.replace(knapspec, probe_rounds=None)
    m = clasp_skip_count(target_config) if skip_count is None else int(skip_count)
    planner = ClaspPlanner(m, gamma=knapspec.gamma_max, latency=latency, tau=NO_PRUNING,
                           branch_chunk=knapspec.branch_chunk)
    result = knapspec_generate(target_params, target_config, prompts, latency=latency, knapspec=knapspec,
                               planner=planner, **kwargs)
    result.metrics["clasp_skip_count"] = m
    return result


__all__ = ["CLASP_SKIP_COUNTS", "ClaspPlanner", "backtrack_coupled", "clasp_generate", "clasp_skip_count",
           "coupled_knapsack_dp", "coupled_knapsack_reference", "plan_coupled_skip_set"]
