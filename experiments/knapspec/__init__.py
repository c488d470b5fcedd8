"""``python -m experiments.run knapspec``: KnapSpec against AR, CLaSp, a static skip set and its ablations.

For every (task, prompt length, batch) *case* the prompts are prefilled once; every method then
decodes from a copy of that cache, and each method's run is paired with an autoregressive run
decoded just before it in the same process (same cache, same capacity, same load), so the
speed-up compares runs that saw the same machine. Both are greedy and are checked token for
token (``identical_to_ar``). Each method runs twice (a warm-up that compiles, then the timed
run); compile time is reported apart.

Methods (``--methods``):

* ``knapspec`` -- the TPT planner (decoupled sub-layers, gamma* honoured: gamma* = 0 runs plain
  decoding until the next plan);
* ``knapspec-official`` -- the authors' behaviour: always draft up to gamma_max with early exit,
  whatever gamma* (their code ignores the planner's gamma);
* ``knapspec-tpl`` / ``knapspec-coupled`` -- the objective and item ablations;
* ``knapspec-target-ref`` -- KnapSpec whose DP's reference tokens see the target's K/V of the earlier
  tokens (``reference_kv="target"``, docs/methods.md §4.3) instead of the candidate's own;
* ``clasp`` -- whole-layer DP with a fixed skip count, re-optimised every 64 rounds;
* ``static-skip`` -- one skip set chosen offline on calibration text (another book), never changed.

Per case also: the DP's candidate skip sets on the case's own text (reference = the first
generated tokens), ``--candidate-plans`` of them (spread over the skipped weights, plus the
planner's own choice) run as fixed plans (no re-planning) to correlate the predicted TPT and the
DP's acceptance estimate with measured throughput (Pearson) and to set each candidate's acceptance
estimate under both DP references (``alpha_branch``, ``alpha_target``, docs/methods.md §4.3)
against its measured acceptance, and a time split (planning measured; draft / verify / plain-decoding seconds estimated from
per-forward timings times the counted forwards). ``plan_cost`` cases time the planner with and
without the stacked-weights reuse on the same reference window.

Latency model (``--latency-fit``, default ``forward``): fitted on whole forwards of the model as
the engine runs them (:func:`jaxspec.knapspec.latency.profile_latency_forward`), or ``isolated``
(each sub-layer timed alone, the original profile). The profile file name ends in the method;
each case records the model's step / draft / verification times and its decode time for the
counted forwards next to the measured decode (``latency_prediction``).

Real weights (``--model smollm2-135m``, a registry name or a path) summarise a long Austen text
(``summarize``) or continue a short one for many tokens (``long-generation``); random weights
(``--model random:PRESET``, e.g. ``random:qwen2.5-7b-shape``; ``--layers N`` for a tiny copy)
use random prompt tokens: acceptance there means nothing, the latency-driven skip pattern does.
"""

# ``knapspec --help`` prints the docstring above (experiment.register reads it from here).
#
# The package's modules, each importing only those above it:
#
# * flags            -- the flags of generate's self-speculative methods and the planning flags the experiment shares,
#                       their checks and the KnapSpecConfig built from them (no JAX at import: the CLI parses flags
#                       without it)
# * model            -- the model a run decodes with (real or random weights) and a case's prompts
# * latency_profiles -- where a latency profile is saved, and loading or measuring it (generate's and the experiment's)
# * self_spec        -- generate --method knapspec | clasp | static-skip | knapspec-budget | knapspec-dustin: the
#                       runner, registered with experiments.registry on import
# * measure          -- what a case measures beside its decode (AR run, forward timings, Pearson, stretch fit) and
#                       the DP's shape
# * case             -- Case: one (task, prompt length, batch) case, every method on copies of one prefilled cache
# * reporting        -- the results' tables and figure
# * bench_plan       -- bench-plan (one plan's stages timed alone) and reprice-tpt
# * experiment       -- the knapspec experiment: register (its flags, bench-plan's and reprice-tpt's), the config its
#                       results record, its checks and its driver (cmd_knapspec, run_case, correlation)
#
# The names below are re-exported so ``experiments.knapspec.NAME`` reads them; a test that patches a name patches it
# in the module that looks it up.

from experiments.knapspec.flags import (DEFAULT_CALIBRATION_FILE, DEFAULT_LATENCY_FIT, DP_LAYERS, DP_SEGMENTS,
                                        LATENCY_FITS, REPROFILE_HELP, WEIGHT_CAP, add_planning_arguments,
                                        add_self_spec_args, check_clasp_skip_count, check_dp_attention, check_two_stage,
                                        experiment_knapspec_config, knapspec_config_from_args, parse_gamma_buckets,
                                        plan_fraction, validate_knapspec_dustin, validate_self_spec)
from experiments.knapspec.model import CALIBRATION_BOOK, INSTRUCTION, PROMPT_BOOKS, Model, book_ids, build_prompts, load
from experiments.knapspec.latency_profiles import (SAVED_LATENCY_FIELDS, default_profile_path, latency_profile,
                                                   load_latency, profile_contexts, resumed_latency_profile,
                                                   token_slope)
from experiments.knapspec.self_spec import (KNAPSPEC_DUSTIN, SELF_SPEC_METHODS, plan_table_rows, report_self_spec,
                                            run_self_spec, self_spec_reserve)
from experiments.knapspec.measure import (DP_CHECK_ROW_BLOCKS, ar_run, auto_branch_chunk, budget_draft_times, dp_shape,
                                          forward_times, pearson, stretch_fit, timed_as)
from experiments.knapspec.case import Case
from experiments.knapspec.reporting import plot, report
from experiments.knapspec.bench_plan import (check_bench_plan_args, cmd_bench_plan, cmd_reprice_tpt, dp_stage,
                                             plan_masks_from)
from experiments.knapspec.experiment import (METHODS, TASKS, check_knapspec_args, cmd_knapspec, correlation,
                                             plan_cost_scale_from, register, run_case)

__all__ = [
    # flags
    "DEFAULT_CALIBRATION_FILE", "DEFAULT_LATENCY_FIT", "DP_LAYERS", "DP_SEGMENTS", "LATENCY_FITS", "REPROFILE_HELP",
    "WEIGHT_CAP",
    "add_planning_arguments", "add_self_spec_args", "check_clasp_skip_count", "check_dp_attention", "check_two_stage",
    "experiment_knapspec_config", "knapspec_config_from_args", "parse_gamma_buckets", "plan_fraction",
    "validate_knapspec_dustin", "validate_self_spec",
    # model
    "CALIBRATION_BOOK", "INSTRUCTION", "PROMPT_BOOKS", "Model", "book_ids", "build_prompts", "load",
    # latency_profiles
    "SAVED_LATENCY_FIELDS", "default_profile_path", "latency_profile", "load_latency", "profile_contexts",
    "resumed_latency_profile", "token_slope",
    # self_spec
    "KNAPSPEC_DUSTIN", "SELF_SPEC_METHODS", "plan_table_rows", "report_self_spec", "run_self_spec", "self_spec_reserve",
    # measure
    "DP_CHECK_ROW_BLOCKS", "ar_run", "auto_branch_chunk", "budget_draft_times", "dp_shape", "forward_times", "pearson",
    "stretch_fit", "timed_as",
    # case, reporting, bench_plan, experiment
    "Case", "plot", "report", "check_bench_plan_args", "cmd_bench_plan", "cmd_reprice_tpt", "dp_stage",
    "plan_masks_from", "METHODS", "TASKS", "check_knapspec_args", "cmd_knapspec", "correlation",
    "plan_cost_scale_from", "register", "run_case",
]
