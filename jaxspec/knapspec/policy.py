"""KnapSpec for the speculative engine: a self-draft policy, the re-planning schedule, a driver.

* :class:`KnapSpecDraft` -- a draft policy (the engine contract of
  :mod:`jaxspec.decoding.policies`): the target with the sub-layers of ``state["skip_mask"]``
  ``[L, 2]`` skipped (a dynamic mask: a new plan needs no recompile), drafting up to
  ``min(engine gamma, state["gamma_cap"])`` tokens (the cap is the plan's gamma*, a dynamic
  value) with **early exit**: the draft loop is a ``lax.while_loop`` that stops once every row
  has drafted a token whose probability is below ``early_exit`` (0.7; the token itself is
  kept, as in the official code). The engine's proposal has a static length ``gamma``, so the
  remaining positions are filled with the last drafted token (one-hot draft distribution) and
  ``Proposal.num_drafted`` tells the engine how many are real: fillers are never accepted and
  never counted as drafted (``acceptance_rate`` = accepted / really drafted tokens).
  ``state["draft_steps"]`` counts the draft forwards actually run.
* :class:`KnapSpecSchedule` -- when to re-plan: before the first plan the draft is the full
  model; the DP runs after round ``plan_round`` (6) of every ``plan_interval`` (64) rounds
  (rounds 6, 70, 134, ...), on the tokens committed in the last ``reference_rounds`` (5) rounds,
  with ``t_attn`` at the *current* context length (official code: accumulate at
  ``step % 64 in 2..6``, optimise at ``step % 64 == 6``). Planning budget (docs/methods.md §5,
  ``KnapSpecConfig.max_plan_fraction``, default 5 %): a plan on this grid is skipped to a later
  grid point while the previous plan cost more than that fraction of the decode time since it, and
  no re-plan runs that would take the run's planning (priced as the previous plan) past that fraction
  of the run's projected decode time.
* :class:`KnapSpecController` -- the driver, an engine controller
  (:class:`~jaxspec.decoding.contract.Controller`): the engine's jitted ``while_loop`` runs in
  chunks between schedule events, and at each plan event a *planner* (:class:`KnapSpecPlanner`: reference states
  (:func:`~jaxspec.knapspec.dp.boundary_states`), DP (:func:`~jaxspec.knapspec.dp.knapsack_dp`),
  grid search (:func:`~jaxspec.knapspec.planner.choose_plan`); CLaSp and the static skip set of
  :mod:`jaxspec.baselines` plug in here) sets the new mask and gamma.
* :func:`knapspec_generate` -- :func:`~jaxspec.decoding.speculative.speculative_generate` with
  :class:`KnapSpecDraft` and a :class:`KnapSpecController` (so mesh, ``profile=True``, warm-up
  and prefilled caches are the engine's).

Per-plan gamma (``KnapSpecConfig.honor_gamma``, default on; off = the official code, which
reports gamma* but always drafts up to gamma_max):

* gamma* >= 1: drafting is capped at gamma* (dynamic, no recompile) and the verification runs
  ``b + 1`` rows, ``b`` the smallest of ``gamma_buckets`` (plus gamma_max) >= gamma*. Each
  bucket is a static engine gamma, compiled lazily the first time a plan picks it (one
  compile per bucket per model). Why buckets and not always ``gamma_max + 1`` verification
  rows: on a CPU (or any compute-bound setting) 11 verification rows cost about 2x 3 rows
  (SmolLM2-135M, 1k context: 54 ms vs 24 ms), which the TPT model -- verification = one
  decode step -- does not account for; on a memory-bound GPU the extra rows are nearly free,
  so ``gamma_buckets=()`` (a single compile, verify ``gamma_max + 1`` rows) is the choice there.
  Only ``accepted_histogram`` / ``draft_counts`` have a gamma-sized shape in the loop state;
  they are folded into host totals at a bucket change.
* gamma* = 0 (plain decoding predicted best): the interval until the next plan
  (``plan_interval`` steps, each counted as one round of the schedule) runs the jitted
  autoregressive loop of :mod:`jaxspec.decoding.autoregressive` on the same cache (no draft,
  no verification), so a plan can never make decoding slower than AR beyond the planning
  cost. The next plan then uses the last ``ar_reference_tokens`` committed tokens as its
  reference (an AR interval has no draft rounds to take a reference from). The interval
  bypasses the verify policy: a verify policy whose state follows the committed tokens
  (``update`` hook, e.g. Dustin) is not updated during it.

Measured arbitration (docs/methods.md §5, ``KnapSpecConfig.probe_rounds``, default 8): the grid search
trusts acceptance statistics from a few reference tokens, which can be optimistic (SmolLM2 on a
CPU: the DP's alpha 1.0 on 21 tokens, 0.84 measured; a plan predicted faster than AR ran at
0.8x). So after a plan that drafts, the driver times ``probe_rounds`` speculative rounds and then
as many plain-decoding steps on the live sequence (both commit real tokens) and keeps the faster,
in tokens committed per second, until the next plan. The plain-decoding rate is the better of
the probe's and the latency model's prediction: a short probe's fixed per-call cost weighs more
on a few cheap steps (on the H200 an 8-step probe measured 123 tok/s where AR ran at 171). A
mispredicted plan then costs at most its probe. Both probes have fixed shapes (``max_rounds`` is
traced; a plain-decoding stretch traces its step count into a buffer sized for the whole run), so
nothing compiles in a timed run whichever wins. CLaSp (no plain decoding) runs without it.

Planning allowance (docs/methods.md §5, with ``max_plan_fraction``): before decoding, the planner's
predicted DP cost per reference token (:meth:`KnapSpecPlanner.reference_cost`, from the latency
model's verification-row cost) and the predicted plain-decoding time of the run give how many
reference tokens per row one plan can afford (:func:`reference_allowance`); the DP's window is
capped there, and when fewer than ``min_reference_tokens`` fit, no plan is made and the run
decodes plainly from the start (on a 2-core CPU one SmolLM2 DP costs ~80 decode steps: a
256-token generation cannot pay for it).

Batch > 1 (beyond the official batch-1 code): one skip set for the whole batch; the DP's
value and alpha pool every row's reference tokens (each row attends to its own prefix); the
early exit is batch-level (the loop ends when every row has exited; rows that exited earlier
keep drafting meanwhile, which costs nothing extra in a batched forward, and those tokens are
real drafts: ``num_drafted`` is the loop's count for every row).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.arbitration import measured_arbitration, remaining_steps, two_stretches
from jaxspec.decoding.autoregressive import prefill
from jaxspec.decoding.contract import Chunk, DraftPolicyBase, ScriptedController
from jaxspec.decoding.policies import DenseVerify, Proposal
from jaxspec.decoding.sampling import SamplingConfig, sample_token, sampling_probs
from jaxspec.decoding.speculative import EngineConfig, SpeculativeResult, speculative_generate
from jaxspec.knapspec.budgeted import (BUDGET, DENSE, SKIP, BudgetDPCost, budgeted_forward, check_budget,
                                      plan_choices)
from jaxspec.knapspec.coupled import plan_coupled_skip_set
from jaxspec.knapspec.dp import (DEFAULT_SEGMENTS, DEFAULT_TAU, DP_LAYERS, WEIGHT_CAP, Candidates, boundary_states,
                                 check_history_backend, check_keep_attention, check_reference_kv, knapsack_dp,
                                 knapsack_weights, plan_agreement, skip_budget, window_prefill)
from jaxspec.knapspec.latency import LatencyModel, effective_context
from jaxspec.knapspec.planner import GAMMA_GRID, Plan, Planner, PlannerBase, choose_plan
from jaxspec.models.llama import forward, freeze_skip_mask

#: ``gamma_cap`` meaning "no cap" (the engine's gamma)
NO_GAMMA_CAP = 2 ** 30


# ---------------------------------------------------------------------------- draft policy
@dataclasses.dataclass(frozen=True)
class KnapSpecDraft(DraftPolicyBase):
    """Self-draft with a dynamic ``[L, 2]`` skip mask and early exit (see the module docstring)."""

    config: ModelConfig
    early_exit: Optional[float] = 0.7  # None: always draft gamma tokens
    name: str = "knapspec"
    # a static plan (docs/methods.md §5.3): ``((skip_attn, skip_mlp), ...)`` per
    # layer, removed at trace time -- the draft forward holds only the executed sub-layers and no
    # per-sub-layer ``lax.cond`` (one compile per distinct plan: the policy is a static argument of
    # the engine's loop). None: the dynamic ``state["skip_mask"]``.
    static_mask: Optional[Tuple[Tuple[bool, bool], ...]] = None
    # a static three-choice plan (docs/methods.md §5.4): ``((attn code, mlp code), ...)`` (0 dense, 1 over
    # ``attention_budget = (sinks, window)`` history slots, 2 skip), run by budgeted_forward; None: off
    static_codes: Optional[Tuple[Tuple[int, int], ...]] = None
    attention_budget: Optional[Tuple[int, int]] = None

    def __post_init__(self):
        if self.early_exit is not None and not 0.0 <= self.early_exit <= 1.0:
            raise ValueError(f"early_exit={self.early_exit} must be a probability in [0, 1] or None")
        if self.static_mask is not None:
            shape = np.shape(np.asarray(self.static_mask, bool))
            if shape != (self.config.num_layers, 2) or not all(
                    isinstance(f, bool) for pair in self.static_mask for f in pair):
                raise ValueError(f"static_mask of shape {shape}: expected a tuple of {self.config.num_layers} "
                                 f"(skip_attn, skip_mlp) Python bool pairs (jaxspec.models.llama.freeze_skip_mask)")
        if (self.static_codes is None) != (self.attention_budget is None):
            raise ValueError("static_codes and attention_budget=(sinks, window) go together")
        if self.static_codes is not None:
            codes = np.asarray(self.static_codes)
            if codes.shape != (self.config.num_layers, 2) or not np.isin(codes, (DENSE, BUDGET, SKIP)).all() or (
                    codes[:, 1] == BUDGET).any():
                raise ValueError(f"static_codes of shape {codes.shape}: expected {self.config.num_layers} (attn, mlp) "
                                 f"code pairs, attn in 0 dense / 1 budgeted / 2 skip, mlp in 0 / 2")
            check_budget(*self.attention_budget)

    def _draft_forward(self, draft_params, tokens, cache, mask):
        """``(logits [B, T, V], cache)`` of one draft forward under the plan."""
        if self.static_codes is not None:
            sinks, window = self.attention_budget
            logits, cache, _ = budgeted_forward(draft_params, tokens, cache, config=self.config,
                                                plan=self.static_codes, sinks=sinks, window=window)
            return logits, cache
        out = forward(draft_params, tokens, cache, config=self.config, skip_mask=mask)
        return out.logits, out.cache

    def initial_state(self, skip_mask=None, gamma_cap: Optional[int] = None) -> dict:
        """``skip_mask`` ``[L, 2]`` (default: the full model, the draft before the first plan);
        ``gamma_cap``: draft at most this many tokens per round (default: the engine's gamma)."""
        shape = (self.config.num_layers, 2)
        mask = jnp.zeros(shape, bool) if skip_mask is None else jnp.asarray(skip_mask, bool)
        if mask.shape != shape:
            raise ValueError(f"skip mask shape {mask.shape}; expected {shape}")
        if gamma_cap is not None and int(gamma_cap) < 1:
            raise ValueError(f"gamma_cap={gamma_cap} must be >= 1 (gamma* = 0 is plain decoding, not a draft)")
        cap = NO_GAMMA_CAP if gamma_cap is None else int(gamma_cap)
        return {"skip_mask": mask, "draft_steps": jnp.zeros((), jnp.int32), "gamma_cap": jnp.int32(cap)}

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        raise TypeError("KnapSpecDraft reads the target cache: build its state with initial_state(skip_mask)")

    def _confidence(self, logits, token, sampling: SamplingConfig):
        """Greedy: the top-1 softmax probability; sampling: the drawn token's probability."""
        if sampling.greedy:
            return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
        probs = sampling_probs(logits, sampling)
        return jnp.take_along_axis(probs, token[:, None], axis=-1)[:, 0]

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key):
        mask = self.static_mask if self.static_mask is not None else state["skip_mask"]
        batch = pending.shape[0]
        vocab = self.config.vocab_size
        limit = jnp.clip(state.get("gamma_cap", gamma), 1, gamma)  # the planned gamma (dynamic: no recompile)
        threshold = -1.0 if self.early_exit is None else float(self.early_exit)
        cache = target_cache.with_lengths(committed - 1)
        logits, first_cache = self._draft_forward(draft_params, pending[:, None], cache, mask)
        keys = jax.random.split(key, gamma)
        logits = logits[:, 0]
        first = sample_token(logits, keys[0], sampling)
        tokens = jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(first)
        probs = None
        if not sampling.greedy:
            probs = jnp.zeros((batch, gamma, vocab), jnp.float32).at[:, 0].set(sampling_probs(logits, sampling))
        confident = self._confidence(logits, first, sampling) >= threshold

        def cond(carry):
            i, _, _, _, confident = carry
            return (i < limit) & jnp.any(confident)

        def body(carry):
            i, cache, tokens, probs, confident = carry
            last = jax.lax.dynamic_index_in_dim(tokens, i - 1, axis=1, keepdims=False)
            logits, new_cache = self._draft_forward(draft_params, last[:, None], cache, mask)
            logits = logits[:, 0]
            token = sample_token(logits, keys[i], sampling)
            tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, i, axis=1)
            if probs is not None:
                probs = jax.lax.dynamic_update_index_in_dim(probs, sampling_probs(logits, sampling), i, axis=1)
            confident = confident & (self._confidence(logits, token, sampling) >= threshold)
            return i + 1, new_cache, tokens, probs, confident

        drafted, cache, tokens, probs, _ = jax.lax.while_loop(
            cond, body, (jnp.int32(1), first_cache, tokens, probs, confident))
        real = jnp.arange(gamma)[None, :] < drafted
        filler = jax.lax.dynamic_index_in_dim(tokens, drafted - 1, axis=1, keepdims=True)  # [B, 1]
        tokens = jnp.where(real, tokens, filler)
        if probs is not None:
            probs = jnp.where(real[..., None], probs, jax.nn.one_hot(filler, vocab, dtype=jnp.float32))
        new_state = dict(state, draft_steps=state["draft_steps"] + drafted)
        # the fillers are not drafts: the engine never accepts them and does not count them
        return Proposal(tokens, probs, new_state, cache, num_drafted=jnp.full((batch,), drafted, jnp.int32))


# ---------------------------------------------------------------------------- schedule
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
    # (jaxspec.knapspec.dp.slot_segments: the same plan, ~20 % fewer slot-layers at 4 runs, one compiled body a run);
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
            raise ValueError(f"weight_cap={self.weight_cap!r} must be an integer >= 1 (the heavier sub-layer's knapsack "
                             f"weight is at most this; the official code's {WEIGHT_CAP})")
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


# ---------------------------------------------------------------------------- planning
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


def reference_window(prompt_tokens: np.ndarray, prompt_lengths: np.ndarray, out: np.ndarray, num_out: np.ndarray,
                     cache_lengths: np.ndarray, mark_lengths: np.ndarray, max_tokens: Optional[int] = None,
                     bucket: int = 16):
    """Reference tokens of each row: cache slots ``mark .. now-1`` (committed since the mark and
    already in the target cache), right-padded to a common multiple of ``bucket``.

    Returns ``tokens [B, R]``, ``token_mask [B, R]``, ``prefix_len [B]`` or None if no row has one.
    """
    counts = np.maximum(np.asarray(cache_lengths) - np.asarray(mark_lengths), 0)
    if max_tokens is not None:
        counts = np.minimum(counts, int(max_tokens))
    if counts.max(initial=0) == 0:
        return None
    width = int(-(-counts.max() // bucket) * bucket)
    if max_tokens is not None:  # never wider than the cap (the DP's cost grows with the width)
        width = min(width, int(max_tokens))
    batch = len(counts)
    prefix = np.asarray(cache_lengths) - counts
    tokens = np.zeros((batch, width), np.int32)
    mask = np.zeros((batch, width), np.float32)
    for b in range(batch):
        sequence = np.concatenate([np.asarray(prompt_tokens[b, : prompt_lengths[b]]), np.asarray(out[b, : num_out[b]])])
        tokens[b, : counts[b]] = sequence[prefix[b]: prefix[b] + counts[b]]
        mask[b, : counts[b]] = 1.0
    return tokens, mask, prefix.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class WindowStates:
    """The target's residual stream of each row's last prompt tokens, kept by :func:`prefill_window` for a plan
    at the start (``KnapSpecConfig.plan_at_start``, docs/methods.md §5.6): ``states [2L + 1, B, W, H]``, row
    ``b``'s first ``counts[b]`` valid, covering its positions ``ends[b] - counts[b] .. ends[b] - 1``."""

    states: jax.Array
    counts: np.ndarray
    ends: np.ndarray

    def for_window(self, token_mask, prefix_len) -> Optional[jax.Array]:
        """The states of a reference window (``token_mask [B, R]``, ``prefix_len [B]``: row ``b``'s
        ``token_mask[b].sum()`` tokens from position ``prefix_len[b]``) taken from these, or None where the
        window is not a suffix of each row's kept tokens (then the plan computes its own). A token's state
        depends only on the tokens before it (causal), so a suffix's states are the same values."""
        counts = np.asarray(token_mask).sum(axis=1).astype(np.int64)
        prefix = np.asarray(prefix_len, np.int64)
        start = self.ends - self.counts
        if counts.shape != self.counts.shape or np.any(prefix + counts != self.ends) or np.any(prefix < start):
            return None
        width = np.asarray(token_mask).shape[1]
        index = np.minimum((prefix - start)[:, None] + np.arange(width)[None, :], self.states.shape[2] - 1)
        keep = np.arange(width)[None, :] < counts[:, None]
        taken = jnp.take_along_axis(self.states, jnp.asarray(index)[None, :, :, None], axis=2)
        return jnp.where(jnp.asarray(keep)[None, :, :, None], taken, jnp.zeros((), taken.dtype))

    def rows(self, rows) -> "WindowStates":
        """These states restricted to ``rows`` of the batch (:attr:`KnapSpecConfig.plan_rows`)."""
        rows = np.asarray(rows)
        return WindowStates(self.states[:, jnp.asarray(rows)], self.counts[rows], self.ends[rows])


def prefill_window(target_params, config: ModelConfig, tokens: np.ndarray, lengths: np.ndarray, cache,
                   window: int, bucket: int = 16):
    """Prefill right-padded prompts ``tokens [B, T]`` into an empty ``cache`` (donated) and keep the residual
    stream of each row's last ``min(window, length)`` tokens (docs/methods.md §5.6): all but those tokens go
    through :func:`~jaxspec.decoding.autoregressive.prefill`, those tokens through one forward that writes
    their K/V like a prefill chunk and keeps its sub-layer boundaries
    (:func:`~jaxspec.knapspec.dp.window_prefill`). A plan on that window at the start then needs no
    forward of its own for the target's states. Returns ``(cache, first_logits [B, V], WindowStates)``,
    the first two as :func:`~jaxspec.decoding.autoregressive.prefill` returns them."""
    lengths = np.asarray(lengths, np.int64)
    window, bucket = int(window), max(int(bucket), 1)
    if window < 1:
        raise ValueError(f"prefill_window: window={window} must be >= 1 (the tokens whose states are kept)")
    held = np.asarray(jax.device_get(cache.lengths))
    if held.any():
        raise ValueError(f"prefill_window needs an empty cache; its rows hold {held.tolist()} tokens")
    if lengths.min(initial=1) < 1:
        raise ValueError(f"prefill_window: every prompt needs a token; lengths {lengths.tolist()}")
    counts = np.minimum(lengths, window)
    head = lengths - counts
    if head.max(initial=0) > 0:
        cache, _ = prefill(target_params, config, np.asarray(tokens)[:, : int(head.max())], head, cache)
    width = int(-(-int(counts.max()) // bucket) * bucket)
    tail = np.zeros((len(lengths), width), np.int32)
    for b in range(len(lengths)):
        tail[b, : counts[b]] = np.asarray(tokens)[b, head[b]: lengths[b]]
    states, cache, logits = window_prefill(target_params, config, tail, cache.with_lengths(jnp.asarray(head, jnp.int32)),
                                           head, counts)
    return cache, logits, WindowStates(states, counts, lengths)


def exit_threshold(knapspec: KnapSpecConfig) -> Optional[float]:
    """The early-exit threshold the grid search models, or None (the TPT of docs/methods.md §4.2): the exit-aware
    TPT needs early exit on, plan gammas honoured (the official code ignores them) and TPT."""
    if knapspec.exit_aware_tpt and knapspec.honor_gamma and knapspec.early_exit and knapspec.objective == "tpt":
        return float(knapspec.early_exit)
    return None


#: the profiler annotation around a whole plan; each named stage of plan_skip_set gets ``PLAN_ANNOTATION + "." + stage``
#: (``jax.profiler.TraceAnnotation``: free without a profiler; under one, experiments/trace.py sums the device's
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
    if floor is not None and allowed < int(floor) and fixed + int(floor) * per_token <= budget / knapspec.allowance_margin:
        # the floor's window fits the planning fraction itself: the margin is headroom above the floor, not below it
        allowed = int(floor)
        out["floor_in_margin"] = True
    out["allowed_tokens"] = allowed
    if allowed < knapspec.min_reference_tokens:
        out["skip"] = True
        return out
    out["tokens"] = allowed if knapspec.max_reference_tokens is None else min(allowed, knapspec.max_reference_tokens)
    return out


def planning_rows(token_mask, done, count: int) -> np.ndarray:
    """The ``count`` rows a plan runs on (:attr:`KnapSpecConfig.plan_rows`), in increasing order: unfinished rows
    before finished ones, then the most reference tokens (``token_mask [B, r]``), ties to the lower row."""
    tokens = np.asarray(token_mask).sum(axis=1)
    order = sorted(range(len(tokens)), key=lambda b: (bool(done[b]), -float(tokens[b]), b))
    return np.asarray(sorted(order[:count]), np.int64)


def cache_rows(cache, rows) -> Any:
    """``cache`` (a :class:`~jaxspec.models.cache.KVCache`) restricted to ``rows`` of its batch (a copy of
    those rows' K/V). One compiled gather for every layer's K and V: indexed one array at a time, eagerly, the
    2L gathers are dispatched one by one (56 arrays of the 1.5B's cache shape with 1k slots: 166 ms on the CPU
    against 8.6 ms compiled; on the H200 they were a plan's largest part, 3-4 ms once compiled)."""
    keys, values, lengths = _take_rows(tuple(cache.keys), tuple(cache.values), cache.lengths,
                                       jnp.asarray(np.asarray(rows), jnp.int32))
    return dataclasses.replace(cache, keys=keys, values=values, lengths=lengths)


@jax.jit
def _take_rows(keys, values, lengths, index):
    return tuple(k[index] for k in keys), tuple(v[index] for v in values), lengths[index]


# ---------------------------------------------------------------------------- controller
class KnapSpecController(ScriptedController):
    """The KnapSpec driver as an engine :class:`~jaxspec.decoding.contract.Controller`: re-planning on
    :class:`KnapSpecSchedule` (postponed under ``max_plan_fraction``, the window capped by
    :func:`reference_allowance`), per-plan gamma buckets, plain-decoding stretches for gamma* = 0 and
    the measured arbitration (see the module docstring). ``planner`` None with ``replan=False`` keeps
    ``initial_plan`` for the whole run (a static skip set). The warm-up run keeps the fixed schedule
    (a plan at every interval), so the timed run finds every shape it can meet compiled, and it
    compiles plain decoding whichever mode the timed run takes."""

    def __init__(self, knapspec: KnapSpecConfig, planner=None, *, latency: Optional[LatencyModel] = None,
                 context_n: Optional[float] = None, initial_plan: Optional[Tuple[np.ndarray, int]] = None,
                 replan: bool = True, draft_policy: Optional["KnapSpecDraft"] = None, probe_fixed: bool = False,
                 window_states: Optional[WindowStates] = None):
        if replan and planner is None:
            raise ValueError("KnapSpecController needs a planner to re-plan (or replan=False)")
        if planner is not None and not isinstance(planner, Planner):
            raise TypeError(f"planner {type(planner).__name__} is not a jaxspec.knapspec.planner.Planner (it needs "
                            f"name, plan, latency_model, reference_cost); derive it from PlannerBase")
        self.knapspec, self.planner, self.context_n = knapspec, planner, context_n
        self.initial_plan, self.replan = initial_plan, replan
        # a fixed plan (replan=False) that drafts: probe it against plain decoding once, at the start
        self.probe_fixed = bool(probe_fixed) and not replan
        self.fixed_probe = None  # that probe's record (measured_arbitration) once it ran
        self.latency = latency if latency is not None else (planner.latency_model() if planner is not None else None)
        if knapspec.static_plans and not isinstance(draft_policy, KnapSpecDraft):
            raise ValueError(f"KnapSpecConfig.static_plans compiles KnapSpecDraft for each plan: pass the run's "
                             f"KnapSpecDraft as draft_policy (got {type(draft_policy).__name__})")
        self.draft_policy = draft_policy if knapspec.static_plans else None
        # the prompt's last tokens' target states kept from the prefill (prefill_window): the plan at the start
        # takes its window's states from them when its planner accepts them
        self.window_states = window_states

    def keeps_window_states(self) -> bool:
        """Whether the plan at the start takes its window's target states from the prefill: a plan at the start
        (``plan_at_start``, re-planning, ``start_states="prefill"``) by a planner that accepts them
        (``accepts_window_states``)."""
        return bool(self.replan and self.knapspec.plan_at_start and self.knapspec.start_states == "prefill"
                    and getattr(self.planner, "accepts_window_states", False))

    def keeps_plain_states(self) -> bool:
        """Whether the first plan after plain decoding (``plan_after_plain``) takes its window's target states from
        the plain stretch that decoded those tokens (``start_states="prefill"``: kept by the forward that wrote
        them, docs/methods.md §5.6) instead of computing them."""
        return bool(self.replan and self.knapspec.plan_after_plain is not None and self.knapspec.honor_gamma
                    and self.knapspec.start_states == "prefill"
                    and getattr(self.planner, "accepts_window_states", False))

    def prefill_target(self, target_params, target_config, tokens, lengths, cache):
        """The engine's prefill (:class:`~jaxspec.decoding.contract.Controller`): with
        :meth:`keeps_window_states`, :func:`prefill_window` over the last ``reference_floor`` prompt tokens
        (their states go to the plan at the start); otherwise the plain prefill."""
        if not self.keeps_window_states():
            return prefill(target_params, target_config, tokens, lengths, cache)
        cache, logits, self.window_states = prefill_window(target_params, target_config, tokens, lengths, cache,
                                                           int(self.knapspec.reference_floor),
                                                           self.knapspec.token_bucket)
        return cache, logits

    def _policy_for(self, mask) -> Optional["KnapSpecDraft"]:
        """With ``static_plans``: the draft compiled for ``mask`` (equal plans give equal policies, so jit
        reuses the compiled loop); otherwise None (the run's dynamic mask)."""
        if self.draft_policy is None:
            return None
        return dataclasses.replace(self.draft_policy, static_mask=freeze_skip_mask(np.asarray(mask, bool)))

    def chunks(self, run):
        knapspec, engine, config = self.knapspec, run.engine, run.target_config
        gamma_max = engine.gamma
        fraction = None if run.warmup else knapspec.max_plan_fraction
        self.records: List[PlanRecord] = []
        self.timings = {"plan_s": 0.0}
        decode_start = time.perf_counter()
        self.allowance = None
        self.buckets_used = set()
        self.schedule_rounds = 0
        current = {"gamma": gamma_max, "bucket": gamma_max, "draft_state": None,
                   "policy": self._policy_for(np.zeros((config.num_layers, 2), bool))}
        planner, model, tokens, lengths = self.planner, self.latency, run.prompt_tokens, run.prompt_lengths

        def apply_plan(mask, gamma):
            """Switch to a plan: (mask, gamma); gamma 0 = plain decoding until the next plan."""
            gamma = min(max(int(gamma), 0), gamma_max)
            bucket = knapspec.bucket_for(gamma) if gamma > 0 else current["bucket"]
            base = current["draft_state"] if current["draft_state"] is not None else run.state.draft_state
            current.update(gamma=gamma, bucket=bucket, draft_state=dict(
                base, skip_mask=jnp.asarray(mask, bool), gamma_cap=jnp.int32(max(gamma, 1))))
            if gamma > 0:
                current["policy"] = self._policy_for(mask)

        def take_draft_state():
            state, current["draft_state"] = current["draft_state"], None
            return state

        def advance(rounds: Optional[int], keep_states: bool = False):
            """Run ``rounds`` schedule rounds (None: to the end) under the current plan; ``keep_states``: a plain
            stretch also keeps its tokens' target states (``LiveRun.kept_states``)."""
            if current["gamma"] == 0:
                state = run.state
                remaining = np.asarray(engine.max_new_tokens - state.num_out)[~np.asarray(state.done)]
                steps = int(remaining.max(initial=0))
                steps = steps if rounds is None else min(int(rounds), steps)
                if steps <= 0:
                    return 0
                # one dispatch, the step count traced and the token buffer sized for the whole run: one
                # compile whatever the length (a probe, an interval, a postponed plan's longer stretch)
                yield Chunk(plain_steps=steps, draft_state=take_draft_state(), keep_states=keep_states)
                return steps
            self.buckets_used.add(current["bucket"])
            yield Chunk(rounds=rounds, gamma=current["bucket"], draft_state=take_draft_state(),
                        draft_policy=current["policy"])
            return run.last_chunk

        def arbitrate(n, rounds=None):
            """Time ``probe_rounds`` speculative rounds under the new plan, then as many plain-decoding
            steps; keep the faster (tokens committed per second) until the next plan
            (:func:`~jaxspec.decoding.arbitration.measured_arbitration`). The plain-decoding rate is the
            better of the probe's and the latency model's (active rows per ``LatencyModel.t_plain(n)``): a short
            probe's fixed per-call cost (dispatch, host syncs) weighs more on a few cheap AR steps than
            on the longer speculative rounds, which would favour drafting. With ``probe_pricing="two-stretch"``
            each side runs as two calls priced by their difference instead (no per-call cost on either side;
            the model's rate is recorded only)."""
            rounds = knapspec.probe if rounds is None else int(rounds)
            speculative_gamma = current["gamma"]

            def plain(steps=rounds):
                current["gamma"] = 0
                return (yield from advance(steps))

            ar_model = None
            if model is not None:
                def ar_model(active):
                    return active / max(model.t_plain(n, config.num_layers), 1e-12)
            warm = knapspec.probe_warmup > 0
            two = knapspec.probe_pricing == "two-stretch"
            probe, units = yield from measured_arbitration(
                run, (lambda: two_stretches(advance, rounds)) if two else (lambda: advance(rounds)),
                (lambda: two_stretches(plain, rounds)) if two else plain, rounds=rounds,
                ar_model_rate=ar_model, ar_model_floor=not two,
                warmup_speculative=(lambda: advance(knapspec.probe_warmup)) if warm else None,
                warmup_plain=(lambda: plain(knapspec.probe_warmup)) if warm else None)
            if probe is not None and probe["choice"] == "speculative":
                current["gamma"] = speculative_gamma
            return probe, units

        if self.initial_plan is not None:
            mask, gamma = self.initial_plan
            apply_plan(mask, gamma if knapspec.honor_gamma else gamma_max)
        true_round, mark = 0, None
        self.fixed_probe = None
        if self.probe_fixed and knapspec.probe_rounds and current["gamma"] > 0 and knapspec.honor_gamma:
            # the measured arbitration for a plan made once (docs/methods.md §5.4): its acceptance comes from
            # a few reference tokens, so time it against plain decoding before trusting it for the whole run
            n0 = self.context_n if self.context_n is not None else effective_context(config, lengths, run.capacity)
            self.fixed_probe, true_round = yield from arbitrate(n0, knapspec.probe_rounds)
        last = None  # (plan end time, plan seconds, round) of the previous plan
        schedule = knapspec.schedule
        next_plan = (0 if knapspec.plan_at_start else schedule.next_plan_round(0)) if self.replan else None
        ref_cap = knapspec.max_reference_tokens
        batch = len(lengths)
        row_share = 1.0 if knapspec.plan_rows is None else min(int(knapspec.plan_rows), batch) / batch
        if self.replan and knapspec.honor_gamma:  # the official code always plans and drafts
            n0 = self.context_n if self.context_n is not None else effective_context(config, lengths, run.capacity)
            kept = (self.window_states is not None and self.keeps_window_states()) or self.keeps_plain_states()
            self.allowance = reference_allowance(planner, model, config, n0, engine.max_new_tokens, knapspec,
                                                 row_share=row_share, states_known=kept)
            if kept:
                self.allowance["states_from_prefill" if self.keeps_window_states() else "states_from_plain"] = True
            if self.allowance["skip"]:  # no affordable plan: plain decoding from the start (gamma* = 0)
                apply_plan(np.zeros((config.num_layers, 2), bool), 0)
                next_plan = None
            elif self.allowance["tokens"] is not None:
                ref_cap = int(self.allowance["tokens"])
        plain_start = None  # plan_after_plain: the plain steps before the first plan (a plain step is a round here)
        if next_plan is not None and knapspec.plan_after_plain is not None and knapspec.honor_gamma:
            plain_start = int(knapspec.plan_after_plain)
            apply_plan(np.zeros((config.num_layers, 2), bool), 0)
            next_plan = plain_start
        while next_plan is not None and not run.finished():
            mark_at = schedule.mark_round(next_plan)
            at_start = next_plan == 0
            if next_plan == 0:  # plan_at_start: the prompt's last reference_floor tokens are the whole reference
                mark = np.maximum(np.asarray(run.state.target_cache.lengths) - int(knapspec.reference_floor), 0)
            elif current["gamma"] != 0:  # plain decoding: the reference is taken when planning
                if mark_at > true_round:
                    true_round += yield from advance(mark_at - true_round)
                    if true_round < mark_at:  # every row finished
                        break
                mark = np.asarray(run.state.target_cache.lengths)
            if next_plan > true_round:
                # the stretch before the first plan after plain decoding keeps its tokens' states for that plan
                keep = plain_start is not None and next_plan == plain_start and self.keeps_plain_states()
                run.kept_states = None
                true_round += yield from advance(next_plan - true_round, keep_states=keep)
                if true_round < next_plan:
                    break
            if run.finished():
                break
            if fraction is not None and last is not None:
                # postpone while the previous plan still costs more than the allowed fraction of the
                # decode time since it (the schedule's interval is the minimum spacing)
                since = time.perf_counter() - last[0]
                rounds_since = max(true_round - last[2], 1)
                if last[1] > fraction * since:
                    # the first grid point after the rounds still needed: plans stay on the schedule's grid
                    needed = max((last[1] / fraction - since) / (since / rounds_since), 1.0)
                    next_plan = schedule.next_plan_round(true_round + int(np.ceil(needed)))
                    self.timings["postponed_plans"] = self.timings.get("postponed_plans", 0) + 1
                    continue
                # and over the whole run: no re-plan (priced as the previous one) that would take the run's
                # planning past the fraction of its projected decode time (docs/methods.md §5)
                left = remaining_steps(run)
                done = max(engine.max_new_tokens - left, 1)
                projected = (time.perf_counter() - decode_start) * engine.max_new_tokens / done
                if self.timings["plan_s"] + last[1] > fraction * projected:
                    self.timings["plans_over_run_budget"] = 1
                    next_plan = None
                    break
            with jax.profiler.TraceAnnotation(PLAN_ANNOTATION):  # the whole plan, for profiles
                plan_start = time.perf_counter()
                state = run.state
                cache_lengths = np.asarray(state.target_cache.lengths)  # waits for the device work in flight
                host = {"device_in_flight": time.perf_counter() - plan_start}  # the controller's own parts of a plan
                if current["gamma"] == 0 or mark is None:
                    after_plain = plain_start is not None and next_plan == plain_start
                    mark = np.maximum(cache_lengths - (plain_start if after_plain else knapspec.ar_reference_tokens), 0)
                if knapspec.reference_floor is not None:  # at least this many tokens a row (earlier ones, the prompt's)
                    mark = np.minimum(mark, np.maximum(cache_lengths - int(knapspec.reference_floor), 0))
                window = reference_window(tokens, lengths, np.asarray(state.out), np.asarray(state.num_out),
                                          cache_lengths, mark, ref_cap, knapspec.token_bucket)
                mark = None
                if window is not None:
                    ref_tokens, token_mask, prefix = window
                    n = self.context_n if self.context_n is not None else effective_context(
                        config, cache_lengths, state.target_cache.capacity)
                    plan_cache = state.target_cache
                    kept = self.window_states if at_start and self.keeps_window_states() else None
                    from_plain = kept is None and run.kept_states is not None
                    if from_plain:  # the plain stretch that decoded the window kept its states
                        states, first, count = run.kept_states
                        count = np.asarray(count, np.int64)
                        kept = WindowStates(states, count, np.asarray(first, np.int64) + count)
                    run.kept_states = None
                    if knapspec.plan_rows is not None and int(knapspec.plan_rows) < batch:
                        rows = planning_rows(token_mask, np.asarray(state.done), int(knapspec.plan_rows))
                        ref_tokens, token_mask, prefix = ref_tokens[rows], token_mask[rows], prefix[rows]
                        plan_cache = cache_rows(plan_cache, rows)
                        kept = None if kept is None else kept.rows(rows)
                        jax.block_until_ready(plan_cache.keys)
                    window_states = None if kept is None else kept.for_window(token_mask, prefix)
                    host["window"] = time.perf_counter() - plan_start - host["device_in_flight"]
                    extra = {} if window_states is None else {"states": window_states}
                    plan, candidates, weights = planner.plan(run.target_params, config, plan_cache,
                                                             jnp.asarray(ref_tokens), jnp.asarray(token_mask),
                                                             jnp.asarray(prefix), n, **extra)
                    del plan_cache
                    applying = time.perf_counter()
                    apply_plan(plan.mask, plan.gamma if knapspec.honor_gamma else gamma_max)
                    search = knapspec.search_tokens
                    priced = plan_price(planner, config, n, knapspec, row_share, window_states is not None,
                                        two_stage=search is not None and ref_tokens.shape[1] > search)
                    # the allowance's prediction, as it priced the plan
                    cost = None if priced is None else priced[0] + priced[1] * ref_tokens.shape[1]
                    host["apply"] = time.perf_counter() - applying
                    self.records.append(PlanRecord(
                        true_round, plan, candidates, int(token_mask.sum()), weights, time.perf_counter() - plan_start,
                        gamma_used=current["gamma"], verify_rows=current["bucket"] + 1 if current["gamma"] else 1,
                        context_length=float(np.mean(cache_lengths + 1)), planner=planner.name,
                        predicted_seconds=cost, rows=int(ref_tokens.shape[0]), host_seconds=host,
                        states_from_prefill=window_states is not None and not from_plain,
                        states_from_plain=window_states is not None and from_plain))
                plan_end = time.perf_counter()
            self.timings["plan_s"] += plan_end - plan_start
            last = (plan_end, plan_end - plan_start, true_round)
            if window is not None and knapspec.probe and current["gamma"] > 0 and knapspec.honor_gamma:
                probe, probe_rounds = yield from arbitrate(n)
                true_round += probe_rounds
                self.records[-1].probe = probe
                if probe is not None and probe["choice"] == "ar":
                    self.records[-1].gamma_used, self.records[-1].verify_rows = 0, 1
            if plain_start is not None and next_plan == plain_start:  # a plan_interval of rounds after it
                next_plan = schedule.next_plan_round(true_round + knapspec.plan_interval)
                continue
            # after a plan at the start the schedule's own first grid point is skipped (its window would be
            # the few rounds since)
            next_plan = schedule.next_plan_round(max(true_round, schedule.plan_round if next_plan == 0 else 0) + 1)
        if not run.finished():
            true_round += yield from advance(None)
        if current["draft_state"] is not None:  # a plan made as the last rows finished: keep it in the state
            yield Chunk(rounds=0, gamma=current["bucket"], draft_state=take_draft_state(),
                        draft_policy=current["policy"])
        # compile plain decoding, whichever mode the timed run takes
        if run.warmup and (self.replan or self.probe_fixed) and knapspec.honor_gamma:
            yield Chunk(plain_steps=1)
        self.schedule_rounds = true_round

    def finish(self, run):
        counters, final = run.counters, run.state
        timings = dict(self.timings)
        timings["plan_fraction"] = timings["plan_s"] / max(run.timings["decode_s"], 1e-9)
        metrics = dict(ar_steps=counters.plain_steps, ar_tokens=counters.plain_tokens,
                       ar_intervals=counters.plain_stretches, schedule_rounds=self.schedule_rounds,
                       plain_chunk_seconds=counters.plain_seconds, round_chunk_seconds=counters.round_seconds,
                       chunk_log=[list(entry) for entry in counters.chunk_log],
                       gamma_buckets_used=sorted(self.buckets_used), honor_gamma=self.knapspec.honor_gamma,
                       knapspec_plans=[r.summary() for r in self.records], plan_allowance=self.allowance,
                       fixed_plan_probe=self.fixed_probe,
                       draft_steps=int(final.draft_state["draft_steps"]),
                       static_plans=self.draft_policy is not None,
                       compiled_plans=len(counters.draft_policies),
                       final_skip_mask=np.asarray(final.draft_state["skip_mask"]).tolist())
        return metrics, timings


def knapspec_generate(target_params, target_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                      latency: Optional[LatencyModel] = None, knapspec: KnapSpecConfig = KnapSpecConfig(),
                      engine: Optional[EngineConfig] = None, max_new_tokens: int = 64,
                      sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (),
                      verify_policy=DenseVerify(), verify_state=None, seed: int = 0, capacity: Optional[int] = None,
                      context_n: Optional[float] = None, warmup: bool = False, planner=None,
                      initial_plan: Optional[Tuple[np.ndarray, int]] = None, replan: bool = True,
                      prefilled=None, profile: bool = False, mesh=None, rules=None,
                      allow_beyond_context: bool = False, static_plan: bool = True,
                      attention_plan: Optional[Tuple[np.ndarray, int, int]] = None,
                      draft_policy=None, probe_fixed_plan: bool = False,
                      window_states: Optional[WindowStates] = None) -> SpeculativeResult:
    """Greedy or sampled speculative generation with KnapSpec self-drafting: the engine's
    :func:`~jaxspec.decoding.speculative.speculative_generate` with :class:`KnapSpecDraft` and a
    :class:`KnapSpecController`.

    ``engine`` defaults to ``EngineConfig(gamma=knapspec.gamma_max, sampling=sampling,
    max_new_tokens=max_new_tokens, stop_tokens=stop_tokens)``; its ``gamma`` is gamma_max (the
    loop state is sized for it; smaller gamma buckets run as chunks of that gamma). ``context_n``
    overrides the context length ``t_attn`` is evaluated at (default: :func:`effective_context`).
    ``planner`` (default ``KnapSpecPlanner(latency, knapspec)``) chooses each plan;
    ``initial_plan=(mask [L, 2], gamma)`` replaces the full-model draft before the first plan
    (gamma 0: plain decoding); ``replan=False`` keeps it for the whole run (a static skip set).
    ``static_plan`` (with ``replan=False`` and an ``initial_plan``): the draft forward is compiled
    for that plan (``KnapSpecDraft.static_mask``: skipped sub-layers removed at trace time, no
    per-sub-layer ``lax.cond``); False keeps the dynamic mask. ``attention_plan=(codes [L, 2], sinks,
    window)`` (with ``replan=False``): draft with that three-choice plan (docs/methods.md §5.4) instead.
    ``probe_fixed_plan`` (with ``replan=False``): time ``knapspec.probe_rounds`` rounds of the fixed plan against as
    many plain-decoding steps at the start and keep the faster for the run (the measured arbitration;
    ``metrics["fixed_plan_probe"]``).
    ``draft_policy``: another self-draft in place of :class:`KnapSpecDraft` (e.g. Dustin's
    ``DustinSelfDraft``, docs/methods.md §5.5): a policy with ``initial_state(skip_mask)`` whose state
    holds ``"skip_mask"``; its state also gets ``"draft_steps"`` and ``"gamma_cap"`` (the controller sets the
    mask and the cap of each plan; a policy that ignores the cap drafts the plan's gamma bucket).

    ``prefilled=(cache, first_logits)``: the prompts already prefilled into a cache of
    ``capacity`` slots (e.g. one prefill shared by several methods in a benchmark); each run
    works on a copy, so the caller's cache stays valid (``timings["prefill_s"]`` is the copy).
    ``profile``, ``mesh``, ``rules``: as the engine's.

    With ``knapspec.plan_at_start`` the plan at the start takes its window's target states from the prefill
    (docs/methods.md §5.6): the engine's prefill keeps them (:meth:`KnapSpecController.prefill_target`), and
    with ``prefilled`` they come as ``window_states`` (the third result of :func:`prefill_window`, which made
    the cache); without them that plan computes its own.

    ``metrics["knapspec_plans"]`` lists every plan (skipped sub-layers, gamma* and the gamma
    used, context length, predicted TPT, seconds); ``metrics["draft_steps"]`` counts draft
    forwards actually run (early exit); ``metrics["ar_steps"]`` / ``["ar_tokens"]`` the plain
    decoding steps and the tokens they committed; ``metrics["tau"]`` counts speculative rounds
    only. ``timings["plan_s"]`` is the planning time inside ``decode_s``.
    """
    if engine is None:
        engine = EngineConfig(gamma=knapspec.gamma_max, sampling=sampling, max_new_tokens=max_new_tokens,
                              stop_tokens=tuple(int(t) for t in stop_tokens))
    if engine.gamma != knapspec.gamma_max:
        raise ValueError(f"engine gamma {engine.gamma} must equal knapspec.gamma_max {knapspec.gamma_max}")
    if engine.fixed_acceptance is not None:
        raise ValueError("knapspec_generate does not support fixed-acceptance mode")
    check_keep_attention(knapspec.keep_attention, target_config.num_layers)
    if planner is None and replan:
        if latency is None:
            raise ValueError("knapspec_generate needs a latency model (or a planner, or replan=False)")
        planner = KnapSpecPlanner(latency, knapspec)
    static_mask = None
    if static_plan and not replan and initial_plan is not None:
        static_mask = freeze_skip_mask(initial_plan[0])
    codes = budget = None
    if attention_plan is not None:
        if replan or initial_plan is None:
            raise ValueError("attention_plan is a fixed plan: it needs replan=False and an initial_plan")
        codes = tuple((int(a), int(m)) for a, m in np.asarray(attention_plan[0], np.int64))
        budget, static_mask = (int(attention_plan[1]), int(attention_plan[2])), None
    if draft_policy is None:
        policy = KnapSpecDraft(target_config, early_exit=knapspec.early_exit, static_mask=static_mask,
                               static_codes=codes, attention_budget=budget)
        draft_state = policy.initial_state()
    else:
        if codes is not None:
            raise ValueError("attention_plan runs KnapSpecDraft's budgeted forward: it takes no draft_policy")
        policy = draft_policy
        draft_state = dict(policy.initial_state(np.zeros((target_config.num_layers, 2), bool)),
                           draft_steps=jnp.zeros((), jnp.int32), gamma_cap=jnp.int32(NO_GAMMA_CAP))
    if not replan:  # static_plans is for re-planning runs; a fixed plan follows static_plan
        knapspec = dataclasses.replace(knapspec, static_plans=False)
    elif knapspec.static_plans and not isinstance(policy, KnapSpecDraft):
        raise ValueError(f"KnapSpecConfig.static_plans compiles KnapSpecDraft for each plan; the draft policy "
                         f"{type(policy).__name__} has its own forward")
    controller = KnapSpecController(knapspec, planner, latency=latency, context_n=context_n,
                                    initial_plan=initial_plan, replan=replan,
                                    draft_policy=policy if knapspec.static_plans else None,
                                    probe_fixed=probe_fixed_plan,
                                    window_states=window_states if prefilled is not None else None)
    return speculative_generate(target_params, target_config, prompts, draft_policy=policy,
                                draft_state=draft_state, verify_policy=verify_policy,
                                verify_state=verify_state, engine=engine, seed=seed, capacity=capacity, warmup=warmup,
                                profile=profile, controller=controller, prefilled=prefilled, mesh=mesh, rules=rules,
                                allow_beyond_context=allow_beyond_context)


def knapspec_budget_generate(target_params, target_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                             latency: LatencyModel, sinks: int, window: int, reference_tokens: int = 64,
                             knapspec: KnapSpecConfig = KnapSpecConfig(), engine: Optional[EngineConfig] = None,
                             max_new_tokens: int = 64, sampling: SamplingConfig = SamplingConfig(),
                             stop_tokens: Sequence[int] = (), seed: int = 0, capacity: Optional[int] = None,
                             context_n: Optional[float] = None, warmup: bool = False,
                             allow_beyond_context: bool = False) -> SpeculativeResult:
    """KnapSpec with budgeted attention (docs/methods.md §5.4): one three-choice plan
    (:func:`~jaxspec.knapspec.budgeted.plan_choices`) on the last ``reference_tokens`` prompt tokens of
    each row (attending to the prompt before them), then a fixed, statically compiled draft for the
    whole run. ``timings["plan_s"]`` (inside ``decode_s``) is the plan; ``metrics["budget_plan"]`` the
    plan's codes, gamma, predicted TPT and alpha. With ``knapspec.plan_rows = N`` the plan uses the first
    N rows' tails only (a copy of their cache rows), as the re-planning KnapSpec does (docs/methods.md
    §5.6): its dense choice attends to each planned row's whole cache for every slot state. The plan
    keeps to the planning allowance (:func:`reference_allowance` with :class:`BudgetDPCost`; ``metrics
    ["plan_allowance"]``): fewer reference tokens where it would cost more, no plan and plain decoding
    (gamma 0) where even ``knapspec.min_reference_tokens`` would not fit. A plan that drafts is then
    probed against plain decoding (``knapspec.probe_rounds`` rounds, the measured arbitration;
    ``metrics["fixed_plan_probe"]``; None = no probe): its acceptance comes from a few reference tokens."""
    from jaxspec.decoding.autoregressive import pad_prompts, prefill
    from jaxspec.models.cache import init_cache

    check_budget(sinks, window)
    if reference_tokens < 1:
        raise ValueError(f"reference_tokens={reference_tokens} must be >= 1")
    tokens, lengths = pad_prompts(prompts)
    if engine is None:
        engine = EngineConfig(gamma=knapspec.gamma_max, sampling=sampling, max_new_tokens=max_new_tokens,
                              stop_tokens=tuple(int(t) for t in stop_tokens))
    capacity = int(capacity) if capacity is not None else int(lengths.max()) + engine.max_new_tokens + engine.gamma + 2
    cache = init_cache(target_config, len(prompts), capacity)
    prefilled = prefill(target_params, target_config, tokens, lengths, cache)
    jax.block_until_ready(prefilled)
    r = int(min(reference_tokens, int(lengths.min()) - 1))
    if r < 1:
        raise ValueError(f"prompts of {int(lengths.min())} tokens leave no reference tokens for the plan")
    n = context_n if context_n is not None else effective_context(target_config, lengths + engine.max_new_tokens,
                                                                  capacity)
    planned = len(prompts) if knapspec.plan_rows is None else min(int(knapspec.plan_rows), len(prompts))
    # the planning allowance (docs/methods.md §5.6) priced for the three-choice DP: fewer reference
    # tokens, or no plan at all (plain decoding) when even the minimum would not fit
    allowance = reference_allowance(BudgetDPCost(latency, sinks, window, knapspec.weight_cap), latency, target_config,
                                    float(n), engine.max_new_tokens, knapspec, row_share=planned / len(prompts))
    if allowance["tokens"] is not None:
        r = min(r, int(allowance["tokens"]))
    prefix = lengths - r
    ref = np.stack([tokens[b, prefix[b]: prefix[b] + r] for b in range(len(prompts))]).astype(np.int32)
    plan_cache, plan_prefix = prefilled[0], prefix
    if planned < len(prompts):
        rows = list(range(planned))  # every row's tail has r tokens: the first rows
        ref, plan_prefix, plan_cache = ref[rows], prefix[rows], cache_rows(plan_cache, rows)

    def plan():
        return plan_choices(target_params, target_config, plan_cache, jnp.asarray(ref),
                            jnp.ones(ref.shape, jnp.float32), jnp.asarray(plan_prefix, jnp.int32), latency, float(n),
                            sinks=sinks, window=window, tau=knapspec.tau, weight_cap=knapspec.weight_cap,
                            gammas=knapspec.plan_gammas)

    if allowance["skip"]:  # no affordable plan: plain decoding from the start (gamma* = 0)
        best, cands, weights, plan_s = None, None, (), 0.0
    else:
        if warmup:  # compile the DP outside the timed plan, as the warm-up run does for the other planners
            plan()
        start = time.perf_counter()
        best, cands, weights = plan()
        plan_s = time.perf_counter() - start
    del plan_cache
    codes = best["plan"] if best is not None else np.zeros((target_config.num_layers, 2), np.int8)
    gamma = (0 if allowance["skip"] else
             min(int(best["gamma"]) if best is not None else knapspec.gamma_max, engine.gamma))
    result = knapspec_generate(target_params, target_config, prompts, knapspec=knapspec, engine=engine, seed=seed,
                               capacity=capacity, warmup=warmup, replan=False, prefilled=prefilled,
                               initial_plan=(codes == SKIP, gamma), attention_plan=(codes, sinks, window),
                               allow_beyond_context=allow_beyond_context,
                               probe_fixed_plan=knapspec.probe_rounds is not None)
    result.timings["plan_s"] = plan_s
    result.timings["decode_s"] = result.timings.get("decode_s", 0.0) + plan_s
    result.metrics["plan_allowance"] = allowance
    result.metrics["budget_plan"] = {
        "codes": np.asarray(codes).tolist(), "gamma": gamma, "sinks": int(sinks), "window": int(window),
        "predicted_tpt": None if best is None else best["tpt"], "alpha": None if best is None else
        float(cands.alpha[best["index"]]), "weights": list(weights), "candidates": 0 if cands is None else len(cands),
        "reference_tokens": 0 if allowance["skip"] else int(r * len(ref)), "rows": int(len(ref)), "n": float(n),
        "plan_s": plan_s, "allowance": allowance,
        "n_dense_attn": int((codes[:, 0] == DENSE).sum()), "n_budget_attn": int((codes[:, 0] == BUDGET).sum()),
        "n_skip_attn": int((codes[:, 0] == SKIP).sum()), "n_skip_mlp": int((codes[:, 1] == SKIP).sum())}
    return result


__all__ = ["KnapSpecConfig", "KnapSpecController", "KnapSpecDraft", "KnapSpecPlanner", "KnapSpecSchedule", "NO_GAMMA_CAP",
           "PlanRecord", "WindowStates",
           "knapspec_budget_generate", "knapspec_generate", "plan_price", "plan_skip_set", "prefill_window", "reference_allowance",
           "reference_window"]
