"""KnapSpec for the speculative engine: a self-draft policy, the re-planning schedule, a driver.

* :class:`KnapSpecDraft` -- a draft policy (the engine contract of
  :mod:`jaxspec.decoding.policies`): the target with the sub-layers of ``state["skip_mask"]``
  ``[L, 2]`` skipped (a dynamic mask: a new plan needs no recompile), drafting up to the
  engine's ``gamma`` (= gamma_max, 10 by default) tokens with **early exit**: the draft loop is a
  ``lax.while_loop`` that stops once every row has drafted a token whose probability is below
  ``early_exit`` (0.7; the token itself is kept, as in the official code). The engine's
  proposal has a static length ``gamma``, so the remaining positions are filled with the last
  drafted token, with a one-hot draft distribution: the acceptance rules stay exact (greedy: a
  filler is accepted only if it *is* the target's argmax; sampling: a deterministic draw from a
  one-hot ``q`` is a valid draw, so rejection sampling still preserves the target
  distribution). The draft compute stops at the exit; the verification still runs
  ``gamma + 1`` rows (see "Engine changes" below). ``state["draft_steps"]`` counts the draft
  forwards actually run.
* :class:`KnapSpecSchedule` -- when to re-plan: before the first plan the draft is the full
  model; the DP runs after round ``plan_round`` (6) of every ``plan_interval`` (64) rounds
  (rounds 6, 70, 134, ...), on the tokens committed in the last ``reference_rounds`` (5) rounds,
  with ``t_attn`` at the *current* context length (official code: accumulate at
  ``step % 64 in 2..6``, optimise at ``step % 64 == 6``).
* :func:`knapspec_generate` -- the host-level driver: prefill, then the engine's jitted
  ``while_loop`` run in chunks between schedule events (the loop is bounded by presetting its
  ``round`` counter; the true count is restored), and at each plan event: reference states
  (:func:`~jaxspec.knapspec.dp.boundary_states`), DP (:func:`~jaxspec.knapspec.dp.knapsack_dp`),
  grid search (:func:`~jaxspec.knapspec.planner.choose_plan`), new mask into the draft state.

Batch > 1 (beyond the official batch-1 code): one skip set for the whole batch; the DP's
value and alpha pool every row's reference tokens (each row attends to its own prefix); the
early exit is batch-level (the loop ends when every row has exited; rows that exited earlier
keep drafting meanwhile, which costs nothing extra in a batched forward).

Engine changes that would make this exact-to-paper and cheaper (not made here):

1. ``Proposal.num_drafted [B]`` (or a batch scalar) and, in ``_commit_phase``,
   ``accepted = min(accepted, num_drafted)``; metrics counting drafted tokens per row -- so
   filler positions are never accepted nor counted as rejections (today they are verified and
   can be accepted when correct, which is lossless but skews ``acceptance_rate``).
2. Verification over ``num_drafted + 1`` rows instead of ``gamma + 1``: needs bucketed static
   lengths (e.g. verify with ``lax.switch`` over a few gamma buckets) since shapes are static.
3. A round limit argument to ``run_loop`` (e.g. ``max_rounds``) or a host callback every
   ``plan_interval`` rounds, instead of presetting ``LoopState.round``.
4. Per-plan gamma: the grid search's gamma* is reported but, as in the official code, drafting
   always uses gamma_max with early exit. gamma* = 0 (plain decoding predicted best) would need
   an AR fallback round in the engine.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import PAD_OUTPUT, pad_prompts, prefill
from jaxspec.decoding.policies import DenseVerify, Proposal
from jaxspec.decoding.sampling import SamplingConfig, sample_token, sampling_probs
from jaxspec.decoding.speculative import EngineConfig, LoopState, SpeculativeResult, run_loop, summarize
from jaxspec.knapspec.dp import DEFAULT_TAU, WEIGHT_CAP, Candidates, boundary_states, knapsack_dp, knapsack_weights
from jaxspec.knapspec.latency import LatencyModel, effective_context
from jaxspec.knapspec.planner import GAMMA_GRID, Plan, choose_plan
from jaxspec.models.cache import check_room, init_cache
from jaxspec.models.llama import _forward


# ---------------------------------------------------------------------------- draft policy
@dataclasses.dataclass(frozen=True)
class KnapSpecDraft:
    """Self-draft with a dynamic ``[L, 2]`` skip mask and early exit (see the module docstring)."""

    config: ModelConfig
    early_exit: Optional[float] = 0.7  # None: always draft gamma tokens
    name: str = "knapspec"

    def __post_init__(self):
        if self.early_exit is not None and not 0.0 <= self.early_exit <= 1.0:
            raise ValueError(f"early_exit={self.early_exit} must be a probability in [0, 1] or None")

    def initial_state(self, skip_mask=None) -> dict:
        """``skip_mask`` ``[L, 2]`` (default: the full model, the draft before the first plan)."""
        shape = (self.config.num_layers, 2)
        mask = jnp.zeros(shape, bool) if skip_mask is None else jnp.asarray(skip_mask, bool)
        if mask.shape != shape:
            raise ValueError(f"skip mask shape {mask.shape}; expected {shape}")
        return {"skip_mask": mask, "draft_steps": jnp.zeros((), jnp.int32)}

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        raise TypeError("KnapSpecDraft reads the target cache: build its state with initial_state(skip_mask)")

    def _confidence(self, logits, token, sampling: SamplingConfig):
        """Greedy: the top-1 softmax probability; sampling: the drawn token's probability."""
        if sampling.greedy:
            return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
        probs = sampling_probs(logits, sampling)
        return jnp.take_along_axis(probs, token[:, None], axis=-1)[:, 0]

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key):
        mask = state["skip_mask"]
        batch = pending.shape[0]
        vocab = self.config.vocab_size
        threshold = -1.0 if self.early_exit is None else float(self.early_exit)
        cache = target_cache.with_lengths(committed - 1)
        out = _forward(draft_params, pending[:, None], cache, config=self.config, skip_mask=mask)
        keys = jax.random.split(key, gamma)
        logits = out.logits[:, 0]
        first = sample_token(logits, keys[0], sampling)
        tokens = jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(first)
        probs = None
        if not sampling.greedy:
            probs = jnp.zeros((batch, gamma, vocab), jnp.float32).at[:, 0].set(sampling_probs(logits, sampling))
        confident = self._confidence(logits, first, sampling) >= threshold

        def cond(carry):
            i, _, _, _, confident = carry
            return (i < gamma) & jnp.any(confident)

        def body(carry):
            i, cache, tokens, probs, confident = carry
            last = jax.lax.dynamic_index_in_dim(tokens, i - 1, axis=1, keepdims=False)
            result = _forward(draft_params, last[:, None], cache, config=self.config, skip_mask=mask)
            logits = result.logits[:, 0]
            token = sample_token(logits, keys[i], sampling)
            tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, i, axis=1)
            if probs is not None:
                probs = jax.lax.dynamic_update_index_in_dim(probs, sampling_probs(logits, sampling), i, axis=1)
            confident = confident & (self._confidence(logits, token, sampling) >= threshold)
            return i + 1, result.cache, tokens, probs, confident

        drafted, cache, tokens, probs, _ = jax.lax.while_loop(
            cond, body, (jnp.int32(1), out.cache, tokens, probs, confident))
        real = jnp.arange(gamma)[None, :] < drafted
        filler = jax.lax.dynamic_index_in_dim(tokens, drafted - 1, axis=1, keepdims=True)  # [B, 1]
        tokens = jnp.where(real, tokens, filler)
        if probs is not None:
            probs = jnp.where(real[..., None], probs, jax.nn.one_hot(filler, vocab, dtype=jnp.float32))
        new_state = {"skip_mask": mask, "draft_steps": state["draft_steps"] + drafted}
        return Proposal(tokens, probs, new_state, cache)


# ---------------------------------------------------------------------------- schedule
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

    def __post_init__(self):
        if not 1 <= self.reference_rounds <= self.plan_round:
            raise ValueError(f"need 1 <= reference_rounds ({self.reference_rounds}) <= plan_round ({self.plan_round})")
        if self.reference_rounds > self.plan_interval or self.plan_interval < 1:
            raise ValueError(f"need reference_rounds ({self.reference_rounds}) <= plan_interval ({self.plan_interval})")
        if self.gamma_max < 1:
            raise ValueError(f"gamma_max={self.gamma_max} must be >= 1")

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

    def is_plan_round(self, r: int) -> bool:
        return r >= self.plan_round and (r - self.plan_round) % self.plan_interval == 0


# ---------------------------------------------------------------------------- planning
@dataclasses.dataclass
class PlanRecord:
    round: int
    plan: Plan
    candidates: Candidates
    reference_tokens: int  # total over rows
    weights: Tuple[int, int]
    seconds: float

    def summary(self) -> dict:
        out = self.plan.summary()
        out.update(round=self.round, reference_tokens=self.reference_tokens, w_attn=self.weights[0],
                   w_mlp=self.weights[1], candidates=len(self.candidates), seconds=self.seconds)
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
    batch = len(counts)
    prefix = np.asarray(cache_lengths) - counts
    tokens = np.zeros((batch, width), np.int32)
    mask = np.zeros((batch, width), np.float32)
    for b in range(batch):
        sequence = np.concatenate([np.asarray(prompt_tokens[b, : prompt_lengths[b]]), np.asarray(out[b, : num_out[b]])])
        tokens[b, : counts[b]] = sequence[prefix[b]: prefix[b] + counts[b]]
        mask[b, : counts[b]] = 1.0
    return tokens, mask, prefix.astype(np.int32)


def plan_skip_set(target_params, config: ModelConfig, cache, tokens, token_mask, prefix_len, latency: LatencyModel,
                  n: float, knapspec: KnapSpecConfig = KnapSpecConfig()) -> Tuple[Plan, Candidates, Tuple[int, int]]:
    """Stage 1 (DP) and stage 2 (grid search) on one reference window."""
    t_attn, t_mlp = latency.t_attn(n), latency.t_mlp()
    w_attn, w_mlp = knapsack_weights(t_attn, t_mlp, knapspec.weight_cap)
    states = boundary_states(target_params, config, tokens, cache, prefix_len)
    candidates = knapsack_dp(target_params, config, cache, prefix_len, states, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                             tau=knapspec.tau, branch_chunk=knapspec.branch_chunk)
    plan = choose_plan(candidates.masks, candidates.alpha, latency, n, gammas=knapspec.gammas,
                       objective=knapspec.objective, exclude_full=knapspec.exclude_full)
    return plan, candidates, (w_attn, w_mlp)


# ---------------------------------------------------------------------------- driver
def _run_rounds(target_params, state: LoopState, rounds: int, true_round: int, static: dict):
    """Run at most ``rounds`` engine rounds (fewer if every row finishes)."""
    limit = static["engine"].max_new_tokens
    start = max(limit - int(rounds), 0)
    state = state._replace(round=jnp.int32(start))
    state = run_loop(target_params, target_params, state, **static)
    done = int(state.round) - start
    return state, true_round + done


def knapspec_generate(target_params, target_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                      latency: LatencyModel, knapspec: KnapSpecConfig = KnapSpecConfig(),
                      engine: Optional[EngineConfig] = None, max_new_tokens: int = 64,
                      sampling: SamplingConfig = SamplingConfig(), verify_policy=DenseVerify(), verify_state=None,
                      seed: int = 0, capacity: Optional[int] = None, context_n: Optional[float] = None,
                      warmup: bool = False) -> SpeculativeResult:
    """Greedy or sampled speculative generation with KnapSpec self-drafting.

    ``engine`` defaults to ``EngineConfig(gamma=knapspec.gamma_max, sampling=sampling,
    max_new_tokens=max_new_tokens)``; its ``gamma`` is gamma_max. ``context_n`` overrides the
    context length ``t_attn`` is evaluated at (default: :func:`effective_context`).
    ``metrics["knapspec_plans"]`` lists every plan; ``metrics["draft_steps"]`` counts draft
    forwards actually run (early exit).
    """
    if engine is None:
        engine = EngineConfig(gamma=knapspec.gamma_max, sampling=sampling, max_new_tokens=max_new_tokens)
    policy = KnapSpecDraft(target_config, early_exit=knapspec.early_exit)
    tokens, lengths = pad_prompts(prompts)
    bad = [int(t) for t in np.unique(tokens) if not 0 <= t < target_config.vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {target_config.vocab_size})")
    gamma = engine.gamma
    capacity = capacity or int(lengths.max()) + engine.max_new_tokens + gamma + 2
    check_room(lengths, capacity, engine.max_new_tokens + gamma + 2,
               f"prompt + {engine.max_new_tokens} new tokens + a draft of gamma={gamma} (+2 headroom)")
    batch = len(lengths)
    static = dict(target_config=target_config, draft_policy=policy, verify_policy=verify_policy, engine=engine)

    def initial_state():  # as speculative_generate's
        cache = init_cache(target_config, batch, capacity)
        cache, first_logits = prefill(target_params, target_config, tokens, lengths, cache)
        key = jax.random.PRNGKey(seed)
        key, sub = jax.random.split(key)
        first = sample_token(first_logits, sub, engine.sampling)
        out = jnp.full((batch, engine.max_new_tokens + gamma + 1), PAD_OUTPUT, jnp.int32).at[:, 0].set(first)
        stop = jnp.asarray(engine.stop_tokens if engine.stop_tokens else (-2,), jnp.int32)
        return LoopState(round=jnp.int32(0), target_cache=cache, draft_state=policy.initial_state(),
                         verify_state=jax.tree.map(jnp.copy, verify_state), out=out,
                         num_out=jnp.ones((batch,), jnp.int32), committed=jnp.asarray(lengths, jnp.int32) + 1,
                         pending=first, previous=jnp.asarray(tokens[np.arange(batch), lengths - 1], jnp.int32),
                         done=jnp.isin(first, stop) | (engine.max_new_tokens <= 1), key=key,
                         active_rounds=jnp.zeros((batch,), jnp.int32),
                         accepted_histogram=jnp.zeros((gamma + 1,), jnp.int32))

    def run():
        start = time.perf_counter()
        state = initial_state()
        jax.block_until_ready(state)
        timings = {"prefill_s": time.perf_counter() - start, "plan_s": 0.0}
        start = time.perf_counter()
        records: List[PlanRecord] = []
        true_round, mark = 0, None
        for kind, at in knapspec.schedule.events():
            if bool(jnp.all(state.done)) or true_round >= engine.max_new_tokens:
                break
            if at > true_round:
                state, true_round = _run_rounds(target_params, state, at - true_round, true_round, static)
                if true_round < at:  # every row finished
                    break
            if kind == "mark":
                mark = np.asarray(state.target_cache.lengths)
                continue
            plan_start = time.perf_counter()
            cache_lengths = np.asarray(state.target_cache.lengths)
            window = reference_window(tokens, lengths, np.asarray(state.out), np.asarray(state.num_out),
                                      cache_lengths, mark, knapspec.max_reference_tokens, knapspec.token_bucket)
            if window is not None:
                ref_tokens, token_mask, prefix = window
                n = context_n if context_n is not None else effective_context(target_config, cache_lengths,
                                                                               state.target_cache.capacity)
                plan, candidates, weights = plan_skip_set(target_params, target_config, state.target_cache,
                                                          jnp.asarray(ref_tokens), jnp.asarray(token_mask),
                                                          jnp.asarray(prefix), latency, n, knapspec)
                draft_state = dict(state.draft_state, skip_mask=jnp.asarray(plan.mask, bool))
                state = state._replace(draft_state=draft_state)
                records.append(PlanRecord(true_round, plan, candidates, int(token_mask.sum()), weights,
                                          time.perf_counter() - plan_start))
            timings["plan_s"] += time.perf_counter() - plan_start
        if not bool(jnp.all(state.done)) and true_round < engine.max_new_tokens:
            state, true_round = _run_rounds(target_params, state, engine.max_new_tokens - true_round, true_round,
                                            static)
        state = state._replace(round=jnp.int32(true_round))
        jax.block_until_ready(state)
        timings["decode_s"] = time.perf_counter() - start
        return state, timings, records

    first_start = time.perf_counter()
    final, timings, records = run()
    if warmup:
        first_total = time.perf_counter() - first_start
        final, timings, records = run()
        timings["compile_s"] = max(first_total - timings["prefill_s"] - timings["decode_s"], 0.0)
    out = np.asarray(final.out)[:, : engine.max_new_tokens]
    num_generated = (out != PAD_OUTPUT).sum(axis=1)
    metrics = summarize(final, engine)
    metrics["knapspec_plans"] = [r.summary() for r in records]
    metrics["draft_steps"] = int(final.draft_state["draft_steps"])
    metrics["final_skip_mask"] = np.asarray(final.draft_state["skip_mask"]).tolist()
    return SpeculativeResult(tokens=out, num_generated=num_generated, prompt_lengths=np.asarray(lengths),
                             metrics=metrics, timings=timings, final_state=final)


__all__ = ["KnapSpecConfig", "KnapSpecDraft", "KnapSpecSchedule", "PlanRecord", "knapspec_generate",
           "plan_skip_set", "reference_window"]
