"""KnapSpec's knobs (:class:`KnapSpecConfig`, the official code's defaults) and its re-planning schedule
(:class:`KnapSpecSchedule`); :mod:`jaxspec.knapspec.policy` gives the overview."""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Tuple

import numpy as np

from jaxspec.knapspec.dp import (DEFAULT_SEGMENTS, DEFAULT_TAU, DP_LAYERS, WEIGHT_CAP, check_history_backend,
                                 check_reference_kv)
from jaxspec.knapspec.planner import GAMMA_GRID


#: values of :attr:`KnapSpecConfig.dp_attention`
DP_ATTENTION = ("xla", "pallas", "pallas-interpret")
#: how a two-stage plan scores its finalists on the whole window (KnapSpecConfig.rescore)
RESCORE = ("executed", "select")
#: where the plan at the start gets its window's target states (KnapSpecConfig.start_states)
START_STATES = ("prefill", "own")
#: KnapSpecConfig.probe_pricing: how the measured arbitration prices its two sides (docs/methods.md §5.2)
PROBE_PRICINGS = ("mean", "two-stretch")


def dp_history_backend(knapspec: "KnapSpecConfig") -> Optional[str]:
    """The ``history_backend`` the sub-layer DP runs with under ``knapspec`` (None: the reference
    attention), from :attr:`KnapSpecConfig.dp_attention`."""
    return check_history_backend(knapspec.dp_attention, knapspec.reference_kv, knapspec.branch_chunk)


@dataclasses.dataclass(frozen=True)
class KnapSpecConfig:
    """KnapSpec knobs (defaults: the official code)."""

    gamma_max: int = 10
    early_exit: Optional[float] = 0.7
    plan_interval: int = 64
    plan_round: int = 6  # the DP runs after this round of every interval
    reference_rounds: int = 5  # rounds whose committed tokens are the DP's reference
    tau: float = DEFAULT_TAU
    weight_cap: int = WEIGHT_CAP
    gammas: Tuple[int, ...] = GAMMA_GRID
    objective: str = "tpt"
    exclude_full: bool = True
    branch_chunk: Optional[int] = None  # DP: branches per attention batch (None = all at once)
    max_reference_tokens: Optional[int] = None  # cap r per row (the latest tokens); None = all
    token_bucket: int = 16  # pad r up to a multiple of this (fewer DP recompiles)
    honor_gamma: bool = True  # False: the official code (draft up to gamma_max whatever gamma*, never AR)
    # static engine gammas (verification rows - 1) a planned gamma is rounded up to; gamma_max is always one
    gamma_buckets: Optional[Tuple[int, ...]] = (1, 2, 3, 4, 6, 8)
    ar_reference_tokens: int = 32  # the DP reference after an interval of plain decoding
    # keep planning under this fraction of decode time: a re-plan whose predecessor cost more than
    # this fraction of the decode time since it is postponed (plan_interval stays the minimum
    # spacing; None = the fixed schedule of docs/methods.md §4). The first plan always runs.
    max_plan_fraction: Optional[float] = 0.05
    # the grid search models early exit (planner module doc: drafts and tokens a round from the DP's
    # confidence statistics); off, or with honor_gamma off (the official code), the TPT of docs/methods.md §4.2
    exit_aware_tpt: bool = True
    # measured arbitration (docs/methods.md §5): after a plan that drafts, time this many speculative rounds
    # and then as many plain-decoding steps on the live sequence; whichever committed tokens faster
    # runs until the next plan. Bounds the loss of a plan whose predicted TPT was too optimistic
    # (acceptance statistics from a few reference tokens) to the probe. None = off (docs/methods.md §4).
    probe_rounds: Optional[int] = 8
    # before each side of a probe, this many rounds (plain steps) run untimed, their tokens committed: the first
    # call after a switch of plan or mode pays one-time costs that would weigh on the few timed rounds of that
    # side alone (docs/methods.md §5.2). 0 = time each side from its first call
    probe_warmup: int = 0
    # how a probe prices its two sides (docs/methods.md §5.2): "mean", the speculative side's mean rate over its
    # one call against the better of the plain side's measured and modelled rates; "two-stretch", each side
    # as two calls (a quarter, then the rest) priced by their difference, so neither carries a per-call cost
    # (after the probe the chosen mode runs in one long call); the model's plain rate is then recorded only
    probe_pricing: str = "mean"
    # with max_plan_fraction: the DP's reference is capped so that one plan's predicted cost fits the
    # planning budget of the run (KnapSpecPlanner.reference_cost); below this many tokens a row no plan
    # is made and the run decodes plainly (the budget cannot pay for a DP)
    min_reference_tokens: int = 8
    # share of the planning budget the first plan's *predicted* cost may use (headroom for the
    # prediction's error: the DP ran 1.05-1.32x its predicted time on the CPU)
    allowance_margin: float = 0.75
    coupled: bool = False  # ablation: whole layers (Attention + MLP together) instead of sub-layers
    # layers whose Attention sub-layer no plan skips (the DP never takes the skip transition there), e.g. a
    # self-draft's Dustin SRH layers, whose executed attention supplies the lookahead signal (docs/methods.md
    # §5.5); () = every Attention of layers 1 .. L-2 may be skipped (the paper)
    keep_attention: Tuple[int, ...] = ()
    # how the DP's reference tokens see one another (docs/methods.md §4.3, jaxspec.knapspec.dp.REFERENCE_KV):
    # "branch" (the paper's: each candidate runs the window as one causal sequence through its own K/V) or
    # "target" (each token attends to the target's K/V of the earlier tokens, the candidate's only at its
    # own position: what a draft step sees). Sub-layer DP only.
    reference_kv: str = "branch"
    # re-planning runs draft each plan with a forward compiled for it (KnapSpecDraft.static_mask: the skipped
    # sub-layers removed at trace time, no per-sub-layer conditional, whose predicate a GPU reads on the host);
    # one compile per distinct plan, kept for the run (docs/methods.md §5.3). False: the dynamic [L, 2] mask.
    # Re-planning runs only: a fixed plan (replan=False) follows knapspec_generate's static_plan
    static_plans: bool = False
    # a two-stage plan (docs/methods.md §5.6): the DP searches on the first search_tokens tokens of each row's
    # reference window only, and the `finalists` candidates of highest TPT on those are scored again (alpha and
    # the exit statistics) on the whole window before the grid search picks one. The DP's cost then grows with
    # search_tokens, the window's only with the finalists. None = the DP on the whole window (the paper)
    search_tokens: Optional[int] = None
    finalists: int = 4
    # the reference window reaches back before its mark until each row has at least this many tokens (the
    # tokens committed earlier, then the prompt's last ones): the last `reference_rounds` rounds commit ~5-55
    # tokens a row, too few to measure a plan's acceptance within a few points (docs/methods.md §5.6). The
    # planning allowance still caps the window (the latest tokens), but not below the floor while the floor's
    # window is predicted within max_plan_fraction (the margin's headroom used). None = the tokens since the mark
    # (the paper)
    reference_floor: Optional[int] = None
    # plan on the reference windows of this many rows of the batch only (docs/methods.md §5.6): the rows with
    # the most reference tokens, ties to the lower row. A plan is one skip set for the whole batch, and the DP's
    # cost grows with its rows, so at batch 16 no window fits the planning allowance; the allowance prices
    # plan_rows / batch of the batch's cost. None = every row (the paper, batch 1)
    plan_rows: Optional[int] = None
    # with reference_floor: the first plan runs before the first round, on the prompt's last reference_floor
    # tokens a row, so no round drafts with the full model (docs/methods.md §5.6); the next plan is the schedule's
    # second (plan_round + plan_interval). False: the first plan after round plan_round (the paper)
    plan_at_start: bool = False
    # the first plan runs after this many plainly decoded tokens a row, on those tokens alone: the model's own
    # continuation, the text the draft will face, where the prompt's last tokens (plan_at_start) or a few early
    # rounds' tokens are another text (docs/methods.md §5.6). The plain steps cost what AR's do, and no round
    # drafts with the full model before the plan. The next plan is plan_interval rounds later on the schedule's
    # grid. None = the paper's first plan after round plan_round
    plan_after_plain: Optional[int] = None
    # the planning allowance multiplies the planner's modelled cost by this: the measured / predicted time of
    # earlier plans of this model on this device (docs/methods.md §5.6; on the H200 the two-stage plan ran 3-11x
    # the model, which prices the DP's rows by plain many-row forwards). 1 = the model alone
    plan_cost_scale: float = 1.0
    # the attention of the DP's branches (sub-layer DP, "branch" reference; jaxspec.knapspec.dp.knapsack_dp's
    # history_backend): "xla" = the vmap-ed reference attention; "pallas" = every branch's rows folded into
    # the query rows of the Pallas history kernel, no scores written (GPU, opt-in like the model's Pallas
    # attention; "pallas-interpret" on any platform, for tests)
    dp_attention: str = "xla"
    # how a two-stage plan scores its finalists on the whole window (jaxspec.knapspec.dp.plan_agreement):
    # "executed" = each finalist's executed sub-layers after its first skip only, behind per-sub-layer conditionals
    # (least arithmetic; a GPU reads every predicate on the host); "select" = every sub-layer of every finalist in
    # one batched pass, kept or dropped by a select (no control flow, the whole model's arithmetic). Same
    # statistics either way; on an H100 select cost 2.9x executed for finalists that skip late, and about what executed
    # cost for a real plan that skips from layer 1 (docs/methods.md §5.6), so executed is the default everywhere
    rescore: str = "executed"
    # the DP's scan in at most this many runs of layers, each over the skipped weights its layers can reach
    # (jaxspec.knapspec.knapsack.slot_segments: the same plan, ~20 % fewer slot-layers at 4 runs, one compiled body a run);
    # 1 = one scan of every slot (docs/methods.md §4.3)
    dp_segments: int = DEFAULT_SEGMENTS
    # how the DP walks the layers (jaxspec.knapspec.dp.DP_LAYERS): "scan" = one lax.scan over a stacked copy of the
    # layer weights (dp_scan, in dp_segments runs); "unrolled" = one traced step per layer on the model's own weights,
    # each sub-layer on the slots it can reach (dp_unrolled: no stacked copy; measured 1.3x faster alone and 1.5x
    # inside a run on the CPU, 1.3-1.4x on an H100). The same candidates either way (docs/methods.md §4.3)
    dp_layers: str = "scan"
    # with plan_at_start: where that plan gets the target's residual stream of its window (docs/methods.md §5.6):
    # "prefill" = kept by the prefill, which runs the window's tokens as its last forward (prefill_window), so the
    # plan runs no forward of its own for them; "own" = the plan computes them (boundary_states), as later plans do
    start_states: str = "prefill"

    def __post_init__(self):
        object.__setattr__(self, "keep_attention", tuple(sorted({int(x) for x in self.keep_attention})))
        check_reference_kv(self.reference_kv)
        if self.dp_attention not in DP_ATTENTION:
            raise ValueError(f"dp_attention={self.dp_attention!r}; valid: {', '.join(DP_ATTENTION)}")
        if self.dp_attention != "xla":
            check_history_backend(self.dp_attention, self.reference_kv, self.branch_chunk)
        if isinstance(self.dp_segments, bool) or int(self.dp_segments) < 1:
            raise ValueError(f"dp_segments={self.dp_segments!r} must be an integer >= 1 (1: one scan of every slot)")
        if self.dp_layers not in DP_LAYERS:
            raise ValueError(f"dp_layers={self.dp_layers!r}; valid: {', '.join(DP_LAYERS)}")
        if isinstance(self.weight_cap, bool) or not isinstance(self.weight_cap, (int, np.integer)) or \
                self.weight_cap < 1:
            raise ValueError(f"weight_cap={self.weight_cap!r} must be an integer >= 1 (the heavier sub-layer's "
                             f"knapsack weight is at most this; the official code's {WEIGHT_CAP})")
        if self.start_states not in START_STATES:
            raise ValueError(f"start_states={self.start_states!r}; valid: {', '.join(START_STATES)}")
        if self.rescore not in RESCORE:
            raise ValueError(f"rescore={self.rescore!r}; valid: {', '.join(RESCORE)}")
        if self.reference_kv != "branch" and self.coupled:
            raise ValueError(f"reference_kv={self.reference_kv!r} is for the sub-layer DP; coupled=True (whole "
                             f"layers, the CLaSp-style ablation) runs the paper's 'branch' reference")
        if any(x < 0 for x in self.keep_attention):
            raise ValueError(f"keep_attention={self.keep_attention}: layers must be >= 0")
        if self.dp_layers != "scan" and self.coupled:
            raise ValueError(f"dp_layers={self.dp_layers!r} is for the sub-layer DP; coupled=True (whole layers) runs "
                             f"its own scan")
        if self.keep_attention and self.coupled:
            raise ValueError(f"keep_attention={self.keep_attention} keeps Attention sub-layers: it needs the "
                             f"sub-layer DP, not coupled=True (whole layers)")
        if not 1 <= self.reference_rounds <= self.plan_round:
            raise ValueError(f"need 1 <= reference_rounds ({self.reference_rounds}) <= plan_round ({self.plan_round})")
        if self.reference_rounds > self.plan_interval or self.plan_interval < 1:
            raise ValueError(f"need reference_rounds ({self.reference_rounds}) <= plan_interval ({self.plan_interval})")
        if self.gamma_max < 1:
            raise ValueError(f"gamma_max={self.gamma_max} must be >= 1")
        if any(int(b) < 1 for b in (self.gamma_buckets or ())):
            raise ValueError(f"gamma_buckets={self.gamma_buckets} must be integers >= 1")
        if self.ar_reference_tokens < 1:
            raise ValueError(f"ar_reference_tokens={self.ar_reference_tokens} must be >= 1")
        if self.max_plan_fraction is not None and not 0 < self.max_plan_fraction < 1:
            raise ValueError(f"max_plan_fraction={self.max_plan_fraction} must be in (0, 1) or None")
        if not 0 < self.allowance_margin <= 1:
            raise ValueError(f"allowance_margin={self.allowance_margin} must be in (0, 1]")
        if self.min_reference_tokens < 1:
            raise ValueError(f"min_reference_tokens={self.min_reference_tokens} must be >= 1")
        if self.probe_pricing not in PROBE_PRICINGS:
            raise ValueError(f"probe_pricing={self.probe_pricing!r} is not one of {', '.join(PROBE_PRICINGS)}")
        if self.probe_rounds is not None and int(self.probe_rounds) < 1:
            raise ValueError(f"probe_rounds={self.probe_rounds} must be >= 1, or None (no arbitration)")
        if isinstance(self.probe_warmup, bool) or not isinstance(self.probe_warmup, (int, np.integer)) or \
                self.probe_warmup < 0:
            raise ValueError(f"probe_warmup={self.probe_warmup!r} must be an int >= 0 (untimed rounds before each "
                             f"side of a probe)")
        if self.search_tokens is not None and int(self.search_tokens) < 1:
            raise ValueError(f"search_tokens={self.search_tokens} must be >= 1, or None (the DP on the whole window)")
        if self.finalists < 1:
            raise ValueError(f"finalists={self.finalists} must be >= 1")
        if isinstance(self.plan_cost_scale, bool) or not isinstance(self.plan_cost_scale, (int, float)) or \
                not 0 < float(self.plan_cost_scale) < float("inf"):
            raise ValueError(f"plan_cost_scale={self.plan_cost_scale!r} must be a finite number > 0 (measured / "
                             f"predicted plan time; 1 = the latency model's price alone)")
        if self.plan_at_start and self.reference_floor is None:
            raise ValueError("plan_at_start=True plans on the prompt's last tokens before any round: it needs "
                             "reference_floor (how many of them a row's window holds)")
        if self.plan_after_plain is not None and (isinstance(self.plan_after_plain, bool)
                                                  or int(self.plan_after_plain) < 1):
            raise ValueError(f"plan_after_plain={self.plan_after_plain!r} must be >= 1 (plain tokens a row before the "
                             f"first plan), or None (the first plan after round plan_round)")
        if self.plan_after_plain is not None and self.plan_at_start:
            raise ValueError(f"plan_after_plain={self.plan_after_plain} and plan_at_start=True both place the first "
                             f"plan: give one")
        if self.reference_floor is not None and int(self.reference_floor) < 1:
            raise ValueError(f"reference_floor={self.reference_floor} must be >= 1, or None (the tokens committed "
                             f"since the window's mark)")
        if self.plan_rows is not None and (isinstance(self.plan_rows, bool) or int(self.plan_rows) < 1):
            raise ValueError(f"plan_rows={self.plan_rows!r} must be >= 1, or None (every row of the batch)")
        if self.search_tokens is not None and self.coupled:
            raise ValueError(f"search_tokens={self.search_tokens} is for the sub-layer DP; coupled=True (whole "
                             f"layers) runs the DP on the whole window")

    @property
    def probe(self) -> int:
        """Rounds per arbitration probe: ``probe_rounds``, at most half of the rounds between a plan and
        the next reference window (both probes must fit there); 0 = no arbitration."""
        if self.probe_rounds is None:
            return 0
        return max(min(int(self.probe_rounds),
                       (self.plan_interval - self.reference_rounds) // 2 - int(self.probe_warmup)), 0)

    @property
    def buckets(self) -> Tuple[int, ...]:
        """Engine gammas in use: the buckets below gamma_max, and gamma_max."""
        return tuple(sorted({int(b) for b in (self.gamma_buckets or ()) if b < self.gamma_max} | {self.gamma_max}))

    def bucket_for(self, gamma: int) -> int:
        """The engine gamma (verification rows - 1) a plan drafting ``gamma`` tokens runs with."""
        return next(b for b in self.buckets if b >= min(int(gamma), self.gamma_max))

    @property
    def plan_gammas(self) -> Tuple[int, ...]:
        """The grid search's gammas: all of ``gammas`` (official), or those <= gamma_max when the
        plan's gamma is honoured (a larger one could not be drafted)."""
        if not self.honor_gamma:
            return tuple(self.gammas)
        grid = tuple(g for g in self.gammas if g <= self.gamma_max)
        if not grid:
            raise ValueError(f"no gamma in {self.gammas} is <= gamma_max={self.gamma_max}")
        return grid

    @property
    def schedule(self) -> "KnapSpecSchedule":
        return KnapSpecSchedule(self.plan_interval, self.plan_round, self.reference_rounds)


@dataclasses.dataclass(frozen=True)
class KnapSpecSchedule:
    """Host-side events, in completed-round counts: ``("mark", r)`` -- remember the committed
    lengths after round ``r`` (start of a reference window); ``("plan", r)`` -- run the DP after
    round ``r`` on the tokens committed since the mark."""

    plan_interval: int = 64
    plan_round: int = 6
    reference_rounds: int = 5

    def plan_rounds(self) -> Iterator[int]:
        r = self.plan_round
        while True:
            yield r
            r += self.plan_interval

    def events(self) -> Iterator[Tuple[str, int]]:
        for r in self.plan_rounds():
            yield "mark", r - self.reference_rounds
            yield "plan", r

    def next_plan_round(self, at_least: int) -> int:
        """The first plan round ``>= at_least`` (the driver's next plan, or a postponed one)."""
        if at_least <= self.plan_round:
            return self.plan_round
        return self.plan_round + -(-(at_least - self.plan_round) // self.plan_interval) * self.plan_interval

    def mark_round(self, plan_round: int) -> int:
        """Where the reference window of the plan at ``plan_round`` starts."""
        return plan_round - self.reference_rounds

    def is_plan_round(self, r: int) -> bool:
        return r >= self.plan_round and (r - self.plan_round) % self.plan_interval == 0


def exit_threshold(knapspec: KnapSpecConfig) -> Optional[float]:
    """The early-exit threshold the grid search models, or None (the TPT of docs/methods.md §4.2): the exit-aware
    TPT needs early exit on, plan gammas honoured (the official code ignores them) and TPT."""
    if knapspec.exit_aware_tpt and knapspec.honor_gamma and knapspec.early_exit and knapspec.objective == "tpt":
        return float(knapspec.early_exit)
    return None


#: the profiler annotation around a whole plan; each named stage of plan_skip_set gets ``PLAN_ANNOTATION + "." + stage``
