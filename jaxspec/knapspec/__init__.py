"""KnapSpec: self-speculative decoding with sub-layer selection as a 0/1 knapsack (docs/methods.md §4).

* :mod:`~jaxspec.knapspec.latency` -- per-sub-layer latency model ``t_mlp = c1``,
  ``t_attn(n) = c2 n + c3``: profilers in our own stack (sub-layers alone, or whole forwards),
  least-squares fits, JSON save/load;
* :mod:`~jaxspec.knapspec.knapsack` -- the knapsack DP over any sub-layers (``lax.scan`` over layers or a loop
  traced once per layer, vectorised over budgets), its Python-loop reference and an exhaustive search;
* :mod:`~jaxspec.knapspec.dp` -- the DP on the model (branch-parallel attention, the window's states, the
  candidates' acceptance estimates);
* :mod:`~jaxspec.knapspec.coupled` -- the same DP with whole layers as items (CLaSp, the coupled ablation);
* :mod:`~jaxspec.knapspec.planner` -- TPT (and TPL), the (skip set, gamma) grid search and the
  :class:`~jaxspec.knapspec.planner.Planner` contract;
* :mod:`~jaxspec.knapspec.policy` -- :func:`knapspec_generate` and its parts: the knobs and the re-planning
  schedule (:mod:`~jaxspec.knapspec.config`), the engine draft policy with its dynamic skip mask and early exit
  (:mod:`~jaxspec.knapspec.draft`), the reference window (:mod:`~jaxspec.knapspec.window`), one plan and its
  allowance (:mod:`~jaxspec.knapspec.skip_planner`) and the engine controller (:mod:`~jaxspec.knapspec.controller`);
* :mod:`~jaxspec.knapspec.budgeted` -- the multiple-choice DP with budgeted attention as a third choice.
"""

from jaxspec.knapspec.dp import (Candidates, boundary_states, knapsack_brute_force, knapsack_dp,
                                 knapsack_dp_reference, knapsack_weights, skip_budget)
from jaxspec.knapspec.latency import (LatencyModel, LatencyProfile, effective_context, fit_forward, fit_latency,
                                      load_or_profile, profile_latency, profile_latency_forward)
from jaxspec.knapspec.planner import Plan, Planner, PlannerBase, choose_plan, expected_tokens, tpt
from jaxspec.knapspec.policy import (KnapSpecConfig, KnapSpecController, KnapSpecDraft, KnapSpecPlanner,
                                     KnapSpecSchedule, PlanRecord, WindowStates, knapspec_generate, plan_skip_set,
                                     prefill_window, reference_window)

__all__ = ["Candidates", "KnapSpecConfig", "KnapSpecController", "KnapSpecDraft", "KnapSpecPlanner",
           "KnapSpecSchedule", "LatencyModel", "LatencyProfile", "Plan", "PlanRecord", "Planner", "PlannerBase",
           "boundary_states", "choose_plan", "effective_context", "expected_tokens", "fit_forward", "fit_latency",
           "knapsack_brute_force", "knapsack_dp", "knapsack_dp_reference", "knapsack_weights", "knapspec_generate",
           "load_or_profile", "plan_skip_set", "prefill_window", "profile_latency", "profile_latency_forward", "reference_window",
           "skip_budget", "tpt", "WindowStates"]
