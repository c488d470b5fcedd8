"""Speculative decoding engine: batched, ragged, lossless (greedy and rejection sampling).

One round: the draft policy proposes ``gamma`` tokens; the target verifies ``gamma + 1`` rows
(``[pending, d_1 .. d_gamma]``) in one forward, attending to the history the verify policy
allows; each row accepts its own prefix plus one correction/bonus token; the caches are rolled
back by setting their lengths (no copies). Rows that emit a stop token or reach their limit
stop while the others go on. All rounds run in one ``lax.while_loop`` (no host round-trip per
token or per round); ``profile=True`` instead runs the three phases as separate jitted calls
per round to measure the draft / verify / other split.

Acceptance:

* greedy: accept the longest prefix with ``d_i == argmax p_{i-1}``, then ``argmax p_n``;
* sampling: accept ``d_i`` with probability ``min(1, p(d_i) / q(d_i))``; at the first rejection
  draw from ``norm(max(0, p - q))``; if all are accepted draw the bonus token from ``p_gamma``
  (``p``, ``q``: target and draft distributions after temperature and top-p);
* fixed acceptance (systems benchmarks only): the number accepted is drawn from a given
  distribution over ``0..gamma`` regardless of the tokens; every output says so.

A draft policy may set ``Proposal.num_drafted [B]`` (real drafts per row, e.g. after an early
exit; the rest are fillers): at most that many are accepted (sampling: standard rejection
sampling with that draft length) and ``acceptance_rate`` divides by the tokens really drafted
(``LoopState.draft_counts``).

The policies and the host-side controller implement the protocols of
:mod:`jaxspec.decoding.contract`. A controller splits a run into chunks
(:class:`~jaxspec.decoding.contract.Chunk`): ``run_loop(..., max_rounds=n)`` returns to the host
after at most ``n`` more rounds (a traced bound: no recompile per value), a chunk may swap the
draft state (a new skip plan) or the engine gamma, or run a plain-decoding stretch
(:func:`plain_decode`) in one dispatch. The default controller runs every round in one call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import PAD_OUTPUT, decode_steps, pad_prompts, prefill, run_with_warmup
from jaxspec.decoding.contract import Chunk, DraftPolicyBase, Proposal, RunToEnd, VerifyPolicyBase, check_policies
from jaxspec.decoding.policies import DenseVerify
from jaxspec.decoding.sampling import SamplingConfig, sample_token, sampling_probs
from jaxspec.models.attention import backend_of
from jaxspec.models.cache import KVCache, check_context, check_room, freeze_rows, init_cache
from jaxspec.models.llama import write_new_kv
from jaxspec.models.sharding import (ACTIVATION_AXES, CACHE_LENGTHS_AXES, constrain, mesh_of, resolve_placement,
                                     shard_params, use_mesh)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    gamma: int = 4
    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int = 64
    stop_tokens: Tuple[int, ...] = ()
    # Systems benchmarks: probabilities of accepting 0..gamma draft tokens per round (None = real acceptance).
    fixed_acceptance: Optional[Tuple[float, ...]] = None
    # A batch's finished rows read none of their history while the loop waits for the others (their
    # caches' rows marked KVCache.frozen each round; docs/methods.md §5.7). False: they run along in full.
    skip_finished_rows: bool = True
    # A round in which no active row drafted a token (a draft policy with can_draft_nothing, e.g. prompt
    # lookup without a match) verifies the pending token alone, chosen on the device each round
    # (docs/methods.md §5.8). The tokens are the same either way; False: gamma + 1 rows every round.
    short_verify: bool = True

    def __post_init__(self):
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma={self.gamma!r} must be an integer >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.fixed_acceptance is not None:
            probs = np.asarray(self.fixed_acceptance, float)
            if probs.shape != (self.gamma + 1,) or (probs < 0).any() or not np.isclose(probs.sum(), 1.0):
                raise ValueError(f"fixed_acceptance must be {self.gamma + 1} probabilities (accept 0..gamma) "
                                 f"summing to 1; got {self.fixed_acceptance}")


def acceptance_from_tau(tau: float, gamma: int) -> Tuple[float, ...]:
    """Distribution of accepted draft tokens (0..gamma) for an i.i.d. per-token acceptance rate
    alpha whose expected tokens per round ``(1 - alpha^(gamma+1)) / (1 - alpha)`` equals ``tau``."""
    if not 1.0 <= tau <= gamma + 1:
        raise ValueError(f"tau={tau} must lie in [1, gamma + 1 = {gamma + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        alpha = (lo + hi) / 2
        expected = sum(alpha ** i for i in range(gamma + 1))
        lo, hi = (alpha, hi) if expected < tau else (lo, alpha)
    alpha = (lo + hi) / 2
    probs = [(alpha ** n) * (1 - alpha) for n in range(gamma)] + [alpha ** gamma]
    return tuple(float(p) for p in probs)


# ---------------------------------------------------------------------------- acceptance
def greedy_accept(target_logits, draft_tokens, num_drafted=None):
    """``target_logits [B, g+1, V]``, ``draft_tokens [B, g]`` -> (accepted [B], next token [B]).
    ``num_drafted [B]``: only the first ``num_drafted`` tokens of a row may be accepted."""
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, g+1]
    match = (draft_tokens == choice[:, :-1]).astype(jnp.int32)
    if num_drafted is not None:
        match = match * (jnp.arange(match.shape[1])[None, :] < num_drafted[:, None])
    accepted = jnp.sum(jnp.cumprod(match, axis=1), axis=1)
    return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]


def rejection_accept(target_logits, draft_tokens, draft_probs, sampling: SamplingConfig, key, num_drafted=None):
    """Standard speculative rejection sampling (distribution preserving). ``num_drafted [B]``: a row
    drafted only its first ``num_drafted`` tokens (standard rejection sampling with that draft length:
    the later positions are never accepted and, when every real draft is accepted, the next token is
    drawn from ``p`` at position ``num_drafted``)."""
    gamma = draft_tokens.shape[1]
    if num_drafted is not None:
        real = jnp.arange(gamma)[None, :] < num_drafted[:, None]
        draft_probs = jnp.where(real[..., None], draft_probs, 0.0)
    p = sampling_probs(target_logits, sampling)  # [B, g+1, V]
    p_draft = jnp.take_along_axis(p[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    key_accept, key_resample = jax.random.split(key)
    u = jax.random.uniform(key_accept, p_draft.shape)
    ok = (u * q_draft < p_draft).astype(jnp.int32)  # u < p/q without dividing by a zero q
    if num_drafted is not None:
        ok = ok * real
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
    p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    q_at = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # all accepted: q_at is zero so the residual is p_gamma; p == q exactly: fall back to p
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_at)
    next_token = jax.random.categorical(key_resample, jnp.log(residual), axis=-1).astype(jnp.int32)
    del gamma
    return accepted, next_token


# ---------------------------------------------------------------------------- loop state
class LoopState(NamedTuple):
    round: jax.Array  # scalar int32
    target_cache: KVCache
    draft_state: Any
    verify_state: Any
    out: jax.Array  # [B, N + gamma + 1] int32
    num_out: jax.Array  # [B]
    committed: jax.Array  # [B] prompt + generated
    pending: jax.Array  # [B]
    previous: jax.Array  # [B]
    done: jax.Array  # [B] bool
    key: jax.Array
    active_rounds: jax.Array  # [B]
    accepted_histogram: jax.Array  # [gamma + 1] counts of rounds (active rows) accepting n drafts
    # {"drafted_histogram": [gamma + 1] rounds (active rows) with n real drafts, "attempts": [gamma]
    # rounds where draft position i was drafted and d_1..d_i accepted}; None = not tracked (all gamma)
    draft_counts: Any = None


def init_draft_counts(gamma: int) -> Dict[str, jax.Array]:
    """Zeroed ``LoopState.draft_counts`` for draft length ``gamma``."""
    return {"drafted_histogram": jnp.zeros((gamma + 1,), jnp.int32), "attempts": jnp.zeros((gamma,), jnp.int32)}


def draft_phase(target_params, draft_params, draft_state, target_cache, pending, previous, committed, key,
                feedback=None, *, target_config, draft_policy, engine):
    """The draft policy's ``propose``; ``feedback``: the verify policy's ``draft_feedback(verify_state)``,
    passed on as ``feedback=`` when it is not ``None``."""
    key, sub = jax.random.split(key)
    extra = {} if feedback is None else {"feedback": feedback}
    proposal = draft_policy.propose(draft_params, draft_state, target_cache, pending, previous, committed,
                                    gamma=engine.gamma, sampling=engine.sampling, key=sub, **extra)
    return proposal, key


def short_verify_supported(verify_policy) -> bool:
    """Whether a round may verify the pending token alone (:attr:`EngineConfig.short_verify`): the verify
    policy runs the base class's forward (its attention set does not depend on the row count) and probes
    nothing (probes are per verified row)."""
    return (not tuple(verify_policy.probe_heads)
            and getattr(type(verify_policy), "verify_forward", None) is VerifyPolicyBase.verify_forward)


def skip_drafts_of(proposal: Proposal, done, *, draft_policy, verify_policy, engine):
    """The ``skip_drafts`` of :func:`verify_phase`: no active row drafted anything. None where the short
    verification does not apply: the engine turns it off, the draft policy never drafts nothing for every
    row (``can_draft_nothing`` false, or no ``num_drafted``), or the verify policy is not
    :func:`short_verify_supported`."""
    if (not engine.short_verify or proposal.num_drafted is None or not getattr(draft_policy, "can_draft_nothing", False)
            or not short_verify_supported(verify_policy)):
        return None
    return jnp.all((proposal.num_drafted <= 0) | done)


def verify_phase(target_params, target_cache, verify_state, committed, pending, draft_tokens, signals,
                 skip_drafts=None, *, target_config, verify_policy, engine):
    """The verification forward of ``[pending, d_1 .. d_gamma]`` (the verify policy's
    ``verify_forward``): ``(logits [B, gamma + 1, V], cache, probes)``. ``skip_drafts`` (traced bool
    scalar, or None): when true, ``pending`` alone is verified and its logits fill all gamma + 1 rows
    (no draft can be accepted then: every row drafted nothing; :attr:`EngineConfig.short_verify`)."""
    rows = jnp.concatenate([pending[:, None], draft_tokens], axis=1)

    def verify(rows, **options):
        return verify_policy.verify_forward(target_params, rows, target_cache, committed, signals,
                                            config=target_config, state=verify_state, **options)

    if skip_drafts is None:
        result = verify(rows)
        return result.logits, result.cache, result.probes
    # The conditional only reads the cache: each branch returns the logits and the new K/V, written after it
    # (a branch that wrote the cache would have XLA copy every layer's K and V through the conditional).
    # short_verify_supported: the policy's forward is the base class's, which takes write_cache.
    width = rows.shape[1]

    def rows_forward(count):
        def run():
            out = verify(rows[:, :count], write_cache=False)
            pad = ((0, 0), (0, 0), (0, width - count), (0, 0))
            logits = jnp.broadcast_to(out.logits, (rows.shape[0], width, out.logits.shape[-1]))
            return logits, jax.tree.map(lambda x: jnp.pad(x, pad), out.new_kv)
        return run

    logits, new_kv = jax.lax.cond(skip_drafts, rows_forward(1), rows_forward(width))
    written = jnp.arange(width)[None, :] < jnp.where(skip_drafts, 1, width)
    start = committed - 1
    return logits, write_new_kv(target_cache.with_lengths(start), new_kv, start, written), None


def commit_phase(state: LoopState, proposal: Proposal, target_logits, target_cache, key, *, engine):
    gamma = engine.gamma
    num_drafted = proposal.num_drafted  # None: every row drafted gamma tokens
    key, k_accept, k_fixed = jax.random.split(key, 3)
    if engine.fixed_acceptance is not None:
        accepted = jax.random.categorical(k_fixed, jnp.log(jnp.asarray(engine.fixed_acceptance)),
                                          shape=state.pending.shape).astype(jnp.int32)
        if num_drafted is not None:
            accepted = jnp.minimum(accepted, num_drafted)
        next_token = jnp.take_along_axis(jnp.argmax(target_logits, -1).astype(jnp.int32), accepted[:, None], 1)[:, 0]
    elif engine.sampling.greedy:
        accepted, next_token = greedy_accept(target_logits, proposal.tokens, num_drafted)
    else:
        accepted, next_token = rejection_accept(target_logits, proposal.tokens, proposal.probs, engine.sampling,
                                                k_accept, num_drafted)
    steps = jnp.arange(gamma + 1)
    block = jnp.where(steps[None, :] < accepted[:, None], jnp.pad(proposal.tokens, ((0, 0), (0, 1))),
                      next_token[:, None])  # [B, g+1]: d_1..d_n, next, (ignored)
    count = accepted + 1
    stop = jnp.asarray(engine.stop_tokens if engine.stop_tokens else (-2,), jnp.int32)
    is_stop = jnp.isin(block, stop) & (steps[None, :] < count[:, None])
    first_stop = jnp.where(is_stop.any(axis=1), jnp.argmax(is_stop, axis=1), gamma + 1)
    count = jnp.minimum(count, first_stop + 1)
    count = jnp.minimum(count, engine.max_new_tokens - state.num_out)
    active = ~state.done
    count = jnp.where(active, count, 0)
    slots = jnp.where(steps[None, :] < count[:, None], state.num_out[:, None] + steps[None, :], state.out.shape[1])
    out = state.out.at[jnp.arange(block.shape[0])[:, None], slots].set(block, mode="drop")
    num_out = state.num_out + count
    done = state.done | is_stop.any(axis=1) & (first_stop < count) | (num_out >= engine.max_new_tokens)
    last = jnp.take_along_axis(block, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    before_last = jnp.where(count >= 2, jnp.take_along_axis(block, jnp.maximum(count - 2, 0)[:, None], 1)[:, 0],
                            state.pending)
    pending = jnp.where(count > 0, last, state.pending)
    previous = jnp.where(count > 0, before_last, state.previous)
    histogram = state.accepted_histogram + jnp.sum(
        jax.nn.one_hot(accepted, gamma + 1, dtype=jnp.int32) * active[:, None].astype(jnp.int32), axis=0)
    draft_counts = state.draft_counts
    if draft_counts is not None:
        drafted = jnp.full_like(accepted, gamma) if num_drafted is None else jnp.minimum(num_drafted, gamma)
        live = active[:, None].astype(jnp.int32)
        position = jnp.arange(gamma)[None, :]
        tried = (position <= accepted[:, None]) & (position < drafted[:, None])  # d_{i+1} drafted, d_1..d_i accepted
        draft_counts = {
            "drafted_histogram": draft_counts["drafted_histogram"] + jnp.sum(
                jax.nn.one_hot(drafted, gamma + 1, dtype=jnp.int32) * live, axis=0),
            "attempts": draft_counts["attempts"] + jnp.sum(tried.astype(jnp.int32) * live, axis=0)}
    # a round with no active row (the end of an unrolled cycle, _loop_fn) is not counted
    return LoopState(round=state.round + jnp.any(active).astype(state.round.dtype),
                     target_cache=target_cache.with_lengths(state.committed - 1 + count),
                     draft_state=proposal.state, verify_state=state.verify_state, out=out, num_out=num_out,
                     committed=state.committed + count, pending=pending, previous=previous, done=done, key=key,
                     active_rounds=state.active_rounds + active.astype(jnp.int32), accepted_histogram=histogram,
                     draft_counts=draft_counts)


def _round(target_params, draft_params, state, *, target_config, draft_policy, verify_policy, engine):
    # the named scopes (ROUND_PHASES) label each phase's kernels in the compiled program, so a device trace can
    # split a fused round's device time by phase (experiments/trace.py)
    frozen = state.done if engine.skip_finished_rows else None  # finished rows read no history this round
    with jax.named_scope("draft"):
        proposal, key = draft_phase(target_params, draft_params, freeze_rows(state.draft_state, frozen),
                                     freeze_rows(state.target_cache, frozen), state.pending,
                                     state.previous, state.committed, state.key,
                                     verify_policy.draft_feedback(state.verify_state), target_config=target_config,
                                     draft_policy=draft_policy, engine=engine)
    with jax.named_scope("verification"):
        logits, cache, probes = verify_phase(target_params, proposal.target_cache, state.verify_state,
                                              state.committed, state.pending, proposal.tokens, proposal.signals,
                                              skip_drafts_of(proposal, state.done, draft_policy=draft_policy,
                                                             verify_policy=verify_policy, engine=engine),
                                              target_config=target_config, verify_policy=verify_policy,
                                              engine=engine)
    with jax.named_scope("commit"):
        new = commit_phase(state, proposal, logits, cache, key, engine=engine)
        if frozen is not None:  # the mark lives for one round: the carried state is as the round found it
            new = new._replace(target_cache=freeze_rows(new.target_cache, None),
                               draft_state=freeze_rows(new.draft_state, None))
        return update_verify_state(state, new, probes, verify_policy=verify_policy)


#: the named scopes of one speculative round, outermost first; Dustin's selection runs inside verification, and a
#: kernel counts towards the innermost of these in its scope path
ROUND_PHASES = ("draft", "verification", "selection", "commit")


def update_verify_state(before: LoopState, after: LoopState, probes, *, verify_policy):
    """The verify policy's ``update(verify_state, probes, num_committed [B], committed [B])`` -> the
    next ``verify_state`` (``num_committed``: tokens committed this round, 0 for finished rows;
    verification row ``num_committed - 1`` is the last token now in the target cache)."""
    return after._replace(verify_state=verify_policy.update(after.verify_state, probes,
                                                            after.committed - before.committed, after.committed))


def _loop_fn(target_params, draft_params, state, max_rounds=None, *, target_config, draft_policy, verify_policy,
             engine):
    # max_rounds (traced scalar, no recompile per value): stop after that many more rounds
    limit = engine.max_new_tokens if max_rounds is None else jnp.minimum(state.round + max_rounds,
                                                                         engine.max_new_tokens)

    def cond(s):
        return (s.round < limit) & ~jnp.all(s.done)

    def body(s, policy=verify_policy):
        return _round(target_params, draft_params, s, target_config=target_config, draft_policy=draft_policy,
                      verify_policy=policy, engine=engine)

    period = int(getattr(verify_policy, "round_period", 1))
    if period == 1:
        final = jax.lax.while_loop(cond, body, state)
    else:
        # a round schedule (VerifyPolicyBase.round_period, docs/methods.md §3.7): whole cycles of `period` rounds
        # per iteration, round j compiled as at_phase(j), so no round carries a conditional choosing its kind.
        # Single rounds (that read their kind from the state) align the cycle first and finish what is left
        # after it. A cycle starts only while `period` rounds fit under `limit` and some row has at least
        # `period * (gamma + 1)` tokens to go (a round commits at most gamma + 1), so no row runs out of tokens
        # inside it; rows that all stop at a stop token inside a cycle leave its last rounds with no row active
        # (they commit nothing and count no round).
        phases = [verify_policy.at_phase(j) for j in range(period)]
        need = period * (engine.gamma + 1)

        def cycle(s):
            for policy in phases:
                s = body(s, policy)
            return s

        def cycle_fits(s):
            to_go = jnp.where(s.done, 0, engine.max_new_tokens - s.num_out)
            return (s.round + period <= limit) & (jnp.max(to_go) >= need)

        state = jax.lax.while_loop(lambda s: cond(s) & (verify_policy.round_phase(s.verify_state) != 0), body,
                                   state)
        state = jax.lax.while_loop(cycle_fits, cycle, state)
        final = jax.lax.while_loop(cond, body, state)
    # under a mesh, the per-row results the host reads come back replicated (readable on every host)
    return final._replace(out=constrain(final.out, ACTIVATION_AXES["output_tokens"]),
                          num_out=constrain(final.num_out, CACHE_LENGTHS_AXES),
                          active_rounds=constrain(final.active_rounds, CACHE_LENGTHS_AXES))


_STATIC = ("target_config", "draft_policy", "verify_policy", "engine")
#: the jitted loop of :func:`run_loop` (donates its state)
loop_jit = jax.jit(_loop_fn, static_argnames=_STATIC, donate_argnames=("state",))
# per-phase versions for profiling: the caches are donated, as inside the fused loop, so no phase pays for a copy
draft_phase_jit = jax.jit(draft_phase, static_argnames=("target_config", "draft_policy", "engine"),
                          donate_argnames=("draft_state", "target_cache"))
verify_phase_jit = jax.jit(verify_phase, static_argnames=("target_config", "verify_policy", "engine"),
                           donate_argnames=("target_cache",))
commit_phase_jit = jax.jit(commit_phase, static_argnames=("engine",), donate_argnames=("proposal", "target_cache"))
update_verify_state_jit = jax.jit(update_verify_state, static_argnames=("verify_policy",), donate_argnames=("after",))


def placed(tree):
    """``tree`` with every array committed to its own placement (no copy). Arrays built on the host
    (``jnp.zeros``, ``jnp.asarray``) are uncommitted, while a jitted call on placed weights (a loaded
    model's) returns committed ones, and jit compiles once per combination: a loop state handed to
    the round loop first from the prefill and later from plain decoding would compile the loop twice
    (seconds at long context, inside a timed run; docs/methods.md §5.2). States are placed on entry."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, tree)


def loop_state_from_caches(target_cache: KVCache, draft_state, pending, previous, engine: EngineConfig, seed: int = 0,
                           verify_state=None, *, key=None, done=None) -> LoopState:
    """A loop state for caches that already hold each row's history (e.g. filled for a benchmark).

    ``target_cache.lengths`` must equal ``committed - 1`` (the pending token is not in it).
    ``key`` defaults to ``PRNGKey(seed)``, ``done`` to no row finished.
    """
    batch = target_cache.batch_size
    out = jnp.full((batch, engine.max_new_tokens + engine.gamma + 1), PAD_OUTPUT, jnp.int32).at[:, 0].set(pending)
    return placed(LoopState(round=jnp.int32(0), target_cache=target_cache, draft_state=draft_state,
                     verify_state=verify_state, out=out, num_out=jnp.ones((batch,), jnp.int32),
                     committed=target_cache.lengths + 1, pending=jnp.array(pending, jnp.int32, copy=True),
                     previous=jnp.array(previous, jnp.int32, copy=True),
                     done=jnp.zeros((batch,), bool) if done is None else done,
                     key=jax.random.PRNGKey(seed) if key is None else key,
                     active_rounds=jnp.zeros((batch,), jnp.int32),
                     accepted_histogram=jnp.zeros((engine.gamma + 1,), jnp.int32),
                     draft_counts=init_draft_counts(engine.gamma)))


def prefill_loop_state(target_params, target_config: ModelConfig, tokens: np.ndarray, lengths: np.ndarray,
                       capacity: int, *, draft_policy, draft_params, draft_state, verify_policy, verify_state,
                       engine: EngineConfig, seed: int = 0, mesh=None, rules=None, prefilled=None,
                       prefill_target=None) -> LoopState:
    """Prefill the target (and the draft policy) with right-padded prompts and sample the first
    token: the state every speculative run starts its rounds from. Given ``draft_state`` /
    ``verify_state`` are copied (the loop donates its state; a warm-up run must not consume them).
    ``prefilled=(target_cache, first_logits [B, V])``: the prompts already prefilled (copied, not
    consumed). ``prefill_target``: the target's prefill, called as
    :func:`~jaxspec.decoding.autoregressive.prefill` (default; a controller's ``prefill_target``)."""
    batch = len(lengths)
    if prefilled is not None:
        target_cache, first_logits = jax.tree.map(jnp.copy, tuple(prefilled))
    else:
        target_cache = init_cache(target_config, batch, capacity, mesh=mesh, rules=rules)
        target_cache, first_logits = (prefill if prefill_target is None else prefill_target)(
            target_params, target_config, tokens, lengths, target_cache)
    state_d = jax.tree.map(jnp.copy, draft_state) if draft_state is not None else draft_policy.prefill(
        draft_params, tokens, lengths, capacity)
    key, sub = jax.random.split(jax.random.PRNGKey(seed))
    first = sample_token(first_logits, sub, engine.sampling)
    stop = jnp.asarray(engine.stop_tokens if engine.stop_tokens else (-2,), jnp.int32)
    previous = jnp.asarray(tokens[np.arange(batch), lengths - 1], jnp.int32)
    state_v = jax.tree.map(jnp.copy, verify_state)
    if state_v is None:  # e.g. Dustin: the last prompt token's query
        state_v = verify_policy.prefill(target_params, target_cache, tokens, lengths)
    return loop_state_from_caches(target_cache, state_d, first, previous, engine, verify_state=state_v, key=key,
                                  done=jnp.isin(first, stop) | (engine.max_new_tokens <= 1))


def precompile_loops(target_params, target_config: ModelConfig, pairs: Sequence[Tuple[Any, Any]], *,
                     tokens: np.ndarray, lengths: np.ndarray, capacity: int, engine: EngineConfig, draft_params=None,
                     draft_state=None, prefilled=None, seed: int = 0, threads: Optional[int] = None) -> Dict[str, Any]:
    """Compile the round loop of several ``(draft_policy, verify_policy)`` pairs at once, before they run.

    XLA compiles one program at a time per caller, and a long-context method's loop takes tens of
    seconds to build, so a run that compares methods spends most of its time compiling one after
    another. Here each pair's initial state is built exactly as :func:`speculative_generate` builds it
    (same arguments, one device, the default controller: every round in one loop) and its loop is
    lowered, one pair after another (tracing holds Python's lock); the state is dropped again, and the
    lowered programs compile in ``threads`` threads (default: one per pair), in parallel since XLA
    releases the lock while it compiles. A later :func:`speculative_generate` with the same arguments
    then finds its loop compiled (JAX's in-process cache, and the persistent cache when it is on).
    Returns ``{"programs", "lower_s", "compile_s", "threads"}``."""
    draft_params = target_params if draft_params is None else draft_params

    def runs():
        for draft_policy, verify_policy in pairs:
            state = prefill_loop_state(target_params, target_config, tokens, lengths, capacity,
                                       draft_policy=draft_policy, draft_params=draft_params, draft_state=draft_state,
                                       verify_policy=verify_policy, verify_state=None, engine=engine, seed=seed,
                                       prefilled=prefilled)
            yield state, dict(target_config=target_config, draft_policy=draft_policy, verify_policy=verify_policy,
                              engine=engine)
            del state  # one state at a time (each holds a copy of the caches)

    return compile_loops(target_params, draft_params, runs(), threads=threads)


def compile_loops(target_params, draft_params, runs, *, threads: Optional[int] = None) -> Dict[str, Any]:
    """Compile :func:`run_loop`'s loop (every round, ``max_rounds=None``) for each ``(state, static)`` of
    ``runs`` (``static``: ``target_config``, ``draft_policy``, ``verify_policy``, ``engine``): lowered one
    after another as ``runs`` yields them (a generator can build each state just before and drop it
    after), then compiled in ``threads`` threads (default: one per program). Nothing runs. A later
    ``run_loop`` on states of the same shapes finds its program compiled. See :func:`precompile_loops`."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    lowered = []
    for state, static in runs:
        lowered.append(loop_jit.lower(target_params, draft_params, state, None, **static))
        del state  # before the next is built: a state can hold a copy of the caches
    lower_s = time.perf_counter() - start
    threads = max(1, min(threads or len(lowered), len(lowered))) if lowered else 0
    start = time.perf_counter()
    if lowered:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda program: program.compile(), lowered))
    return {"programs": len(lowered), "lower_s": lower_s, "compile_s": time.perf_counter() - start,
            "threads": threads}


def run_loop(target_params, draft_params, state: LoopState, *, target_config, draft_policy, verify_policy, engine,
             max_rounds: Optional[int] = None):
    """All rounds in one jitted ``while_loop`` (donates ``state``). ``max_rounds``: stop after at most
    that many rounds (fewer if every row finishes; ``state.round`` keeps counting), e.g. to return
    to the host every planning interval; a traced value, so no recompile per value."""
    limit = None if max_rounds is None else jnp.int32(max_rounds)
    return loop_jit(target_params, draft_params, state, limit, target_config=target_config, draft_policy=draft_policy,
                 verify_policy=verify_policy, engine=engine)


def profile_phases(target_params, draft_params, state: LoopState, *, target_config, draft_policy, verify_policy,
                   engine, return_state: bool = False):
    """Draft / verify / other seconds summed over rounds (per-phase jitted calls; first round excluded).

    The phases donate the state's caches; ``return_state=True`` also returns the final state
    (``(seconds, state)``) so a caller can keep using its caches."""
    totals, final = _profile(target_params, draft_params, state,
                             dict(target_config=target_config, draft_policy=draft_policy,
                                  verify_policy=verify_policy, engine=engine))
    return (totals, final) if return_state else totals


def summarize(final: LoopState, engine: EngineConfig) -> Dict[str, Any]:
    return _metrics(final, engine.gamma, engine)


# ---------------------------------------------------------------------------- plain decoding
def plain_decode_fn(params, state: LoopState, num_steps, *, config: ModelConfig, engine: EngineConfig, steps: int,
                    static_bound: bool = False, keep_states: bool = False):
    """``num_steps`` (traced, 1..``steps``) plain autoregressive steps from the loop state, on the
    same cache, one forward per step from the pending token on; each active row commits its tokens
    up to a stop token or its limit (finished rows run along and commit nothing). ``steps`` (static)
    sizes the token buffer, so every stretch length up to it shares one compile.
    ``static_bound``: the decode loop counts from ``steps - num_steps`` up to the static ``steps`` instead of
    from 0 up to the traced ``num_steps`` (no traced bound carried through the loop, as in the AR loop; the
    tokens are shifted back after it); the same tokens either way.
    ``keep_states`` (not with ``static_bound``): also keep the residual stream of every fed token at every
    sub-layer boundary, ``[2L + 1, B, steps, H]``, column ``i`` the stretch's ``i``-th forward (row ``b``'s
    position ``state.committed[b] - 1 + i``), for a plan on the stretch's tokens (docs/methods.md §5.6).
    Returns (state, tokens committed [B]) (and the states with ``keep_states``)."""
    if keep_states and static_bound:
        raise ValueError("plain_decode: keep_states keeps column i for the stretch's i-th step; static_bound shifts "
                         "the steps (use one or the other)")
    batch = state.pending.shape[0]
    active = ~state.done
    stop = jnp.asarray(engine.stop_tokens if engine.stop_tokens else (-2,), jnp.int32)
    key, loop_key = jax.random.split(state.key)
    # every step, the pending token's included, inside one while loop carrying the donated state's cache:
    # a forward before the loop would make XLA copy the whole cache into the loop and out of it once per
    # call (two cache copies per stretch; docs/methods.md §5.2)
    tokens = constrain(jnp.full((batch, steps), PAD_OUTPUT, jnp.int32), ACTIVATION_AXES["output_tokens"])
    start, end = (steps - jnp.minimum(steps, num_steps), steps) if static_bound else (0, jnp.minimum(steps, num_steps))
    kept = None
    if keep_states:
        kept = jnp.zeros((2 * config.num_layers + 1, batch, steps, config.hidden_size), config.jnp_dtype)
    decoded = decode_steps(params, state.target_cache.with_lengths(state.committed - 1), state.pending,
                           state.done, tokens, loop_key, start, end, config=config,
                           sampling=engine.sampling, stop_tokens=tuple(engine.stop_tokens),
                           skip_finished=engine.skip_finished_rows, states=kept)
    tokens, cache = decoded[:2]
    if static_bound:  # the stretch's tokens sit in columns start .. steps - 1: move them to 0 ..
        padded = jnp.concatenate([tokens, jnp.full_like(tokens, PAD_OUTPUT)], axis=1)
        tokens = jax.lax.dynamic_slice_in_dim(padded, start, steps, axis=1)
    position = jnp.arange(steps)[None, :]
    is_stop = jnp.isin(tokens, stop)
    first_stop = jnp.where(is_stop.any(axis=1), jnp.argmax(is_stop, axis=1), steps)
    count = jnp.minimum(jnp.minimum(first_stop + 1, jnp.minimum(steps, num_steps)),
                        engine.max_new_tokens - state.num_out)
    count = jnp.where(active, jnp.maximum(count, 0), 0)
    slots = jnp.where(position < count[:, None], state.num_out[:, None] + position, state.out.shape[1])
    out = state.out.at[jnp.arange(batch)[:, None], slots].set(tokens, mode="drop")
    num_out = state.num_out + count
    done = state.done | (is_stop.any(axis=1) & (first_stop < count)) | (num_out >= engine.max_new_tokens)
    last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    before_last = jnp.where(count >= 2, jnp.take_along_axis(tokens, jnp.maximum(count - 2, 0)[:, None], 1)[:, 0],
                            state.pending)
    committed = state.committed + count
    state = state._replace(target_cache=cache.with_lengths(committed - 1), out=out, num_out=num_out,
                           committed=committed, pending=jnp.where(count > 0, last, state.pending),
                           previous=jnp.where(count > 0, before_last, state.previous), done=done, key=key)
    return (state, count, decoded[2]) if keep_states else (state, count)


plain_decode = jax.jit(plain_decode_fn, static_argnames=("config", "engine", "steps", "static_bound", "keep_states"),
                       donate_argnames=("state",))


def catch_up_fn(draft_params, state: LoopState, previous, num_out, committed, *, draft_policy, steps: int):
    """The draft's :meth:`~jaxspec.decoding.contract.DraftPolicyBase.catch_up` after plain decoding
    from a state whose ``previous`` / ``num_out`` / ``committed`` were those given: the tokens at
    positions ``committed - 2 ..`` (``previous``, then the committed output from the then-pending
    token on), ``steps`` (static) of them per row, at least the ``committed`` growth since."""
    t = jnp.arange(steps)[None, :]
    index = jnp.clip(num_out[:, None] - 2 + t, 0, state.out.shape[1] - 1)
    tokens = jnp.where(t == 0, previous[:, None], jnp.take_along_axis(state.out, index, axis=1))
    tokens = jnp.maximum(tokens, 0)  # PAD_OUTPUT past a row's end: any token (its K/V is overwritten first)
    return state._replace(draft_state=draft_policy.catch_up(draft_params, state.draft_state, tokens, committed - 2))


catch_up = jax.jit(catch_up_fn, static_argnames=("draft_policy", "steps"), donate_argnames=("state",))


def has_own_cache(draft_policy) -> bool:
    """Whether the draft policy writes a cache of its own that plain decoding leaves behind."""
    method = getattr(type(draft_policy), "catch_up", None)
    return method is not None and method is not DraftPolicyBase.catch_up


# ---------------------------------------------------------------------------- driver
@dataclasses.dataclass
class RunCounters:
    """Host-side totals of a run: acceptance counters folded at each gamma change (sized for
    ``EngineConfig.gamma``), the gammas that ran, and the plain-decoding stretches."""

    gamma: int
    histogram: np.ndarray = None  # [gamma + 1]
    drafted_histogram: np.ndarray = None  # [gamma + 1]
    attempts: np.ndarray = None  # [gamma]
    gammas_used: set = dataclasses.field(default_factory=set)
    draft_policies: set = dataclasses.field(default_factory=set)  # chunks' own draft policies (Chunk.draft_policy)
    plain_steps: int = 0
    plain_tokens: int = 0
    catch_ups: int = 0  # draft-cache catch-ups after plain decoding
    # every chunk in order: ("plain", steps, seconds) or ("rounds", rounds, seconds), the seconds the wall time
    # inside the chunk, ended by its own host read (a plain stretch's token count, the rounds' counter); the rest
    # of a run's decode time is the controller's (planning, probes, its logic). A stretch's fixed cost (dispatch,
    # its host read) shows as the intercept of seconds over steps (docs/methods.md §5.2)
    chunk_log: list = dataclasses.field(default_factory=list)

    @property
    def plain_stretches(self) -> int:
        return sum(kind == "plain" for kind, _, _ in self.chunk_log)

    @property
    def plain_seconds(self) -> float:
        return sum(seconds for kind, _, seconds in self.chunk_log if kind == "plain")

    @property
    def round_seconds(self) -> float:
        return sum(seconds for kind, _, seconds in self.chunk_log if kind == "rounds")

    def __post_init__(self):
        self.histogram = np.zeros(self.gamma + 1, np.int64)
        self.drafted_histogram = np.zeros(self.gamma + 1, np.int64)
        self.attempts = np.zeros(self.gamma, np.int64)

    def fold(self, state: LoopState) -> None:
        histogram = np.asarray(state.accepted_histogram, np.int64)
        self.histogram[: len(histogram)] += histogram
        if state.draft_counts is not None:
            drafted = np.asarray(state.draft_counts["drafted_histogram"], np.int64)
            attempts = np.asarray(state.draft_counts["attempts"], np.int64)
            self.drafted_histogram[: len(drafted)] += drafted
            self.attempts[: len(attempts)] += attempts


@dataclasses.dataclass
class LiveRun:
    """What a :class:`~jaxspec.decoding.contract.Controller` sees between chunks. ``state`` is the
    live :class:`LoopState` (read it; the engine donates it to the next chunk): committed tokens
    ``out [B, N + gamma + 1]`` / ``num_out [B]``, ``target_cache``, ``draft_state``, ``round``, ...
    ``last_chunk`` is what the last chunk ran: speculative rounds or plain-decoding steps."""

    target_params: Any
    target_config: ModelConfig
    engine: EngineConfig
    prompt_tokens: np.ndarray  # [B, T] right-padded
    prompt_lengths: np.ndarray  # [B]
    capacity: int
    state: LoopState
    counters: RunCounters
    warmup: bool = False  # this is the warm-up run (its results are discarded)
    profiling: bool = False  # this is the profile=True pass (per-phase calls)
    decode_start: float = 0.0  # time.perf_counter() when the first chunk started
    timings: Dict[str, float] = dataclasses.field(default_factory=dict)  # prefill_s; decode_s at finish
    last_chunk: int = 0
    plain_from: Optional[tuple] = None  # (previous, num_out, committed) before the current plain stretch
    # a Chunk(keep_states=True)'s target states: (states [2L + 1, B, S, H], first position [B], tokens kept [B])
    kept_states: Optional[tuple] = None

    def finished(self) -> bool:
        return bool(jnp.all(self.state.done))

    def committed_total(self) -> int:
        """Tokens generated over all rows (a host sync: the work before it is done)."""
        return int(jnp.sum(self.state.num_out))

    @property
    def gamma(self) -> int:
        """The engine gamma the loop state's counters are sized for (the last speculative chunk's)."""
        return int(self.state.accepted_histogram.shape[0]) - 1


@dataclasses.dataclass
class SpeculativeResult:
    tokens: np.ndarray  # [B, N], PAD_OUTPUT after a row stopped
    num_generated: np.ndarray
    prompt_lengths: np.ndarray
    metrics: Dict[str, Any]
    timings: Dict[str, float]
    final_state: Any = None  # the LoopState after the last round (caches, counters)

    def rows(self):
        return [row[:n].tolist() for row, n in zip(self.tokens, self.num_generated)]

    @property
    def tokens_per_s(self) -> float:
        return float(self.num_generated.sum()) / max(self.timings["decode_s"], 1e-9)


def check_compatible(target_config: ModelConfig, draft_config: ModelConfig, target_tokenizer=None,
                     draft_tokenizer=None) -> None:
    """Draft and target must share the vocabulary (and the tokenizer, when both are given)."""
    if target_config.vocab_size != draft_config.vocab_size:
        raise ValueError(f"draft vocabulary size {draft_config.vocab_size} != target vocabulary size "
                         f"{target_config.vocab_size}: speculative decoding needs one shared vocabulary")
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError("draft and target tokenizers differ (different token -> id maps): speculative "
                             "decoding needs one shared tokenizer")


def speculative_generate(target_params, target_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                         draft_policy, draft_params=None, draft_state=None, verify_policy=DenseVerify(),
                         verify_state=None, engine: EngineConfig = EngineConfig(), seed: int = 0,
                         capacity: Optional[int] = None, warmup: bool = False, profile: bool = False,
                         prompt_tokens: Optional[Tuple[np.ndarray, np.ndarray]] = None, mesh=None, rules=None,
                         draft_rules=None, controller=None, prefilled=None,
                         allow_beyond_context: bool = False) -> SpeculativeResult:
    """Generate with speculative decoding. ``draft_state`` is built by ``draft_policy.prefill``
    unless given (e.g. ``SelfDraft.initial_state(mask)``); ``verify_state`` by ``verify_policy.prefill``.

    ``controller`` (a :class:`~jaxspec.decoding.contract.Controller`; default
    :class:`~jaxspec.decoding.contract.RunToEnd`: every round in one jitted ``while_loop``) chooses
    the chunks of the run: rounds under a draft state and gamma, or plain-decoding stretches
    (KnapSpec's re-planning, arbitration and fallback). Its ``finish`` adds metrics and timings.

    Multi-device: as :func:`~jaxspec.decoding.autoregressive.generate` -- target params placed
    with ``jaxspec.models.sharding.shard_params`` (or ``mesh``/``rules`` here); a separate draft is
    placed on the same mesh with ``draft_rules`` (default: the target's rules) unless it
    already lives on a mesh; each cache is sharded like its model's weights.

    ``prompt_tokens=(tokens, lengths)`` skips the prompt list. ``prefilled=(cache, first_logits)``:
    the prompts already prefilled into a cache of ``capacity`` slots (e.g. one prefill shared by
    several methods in a benchmark); each run works on a copy, so the caller's cache stays valid.
    ``warmup=True`` runs twice and reports the second (``timings["compile_s"]``: the first's extra
    time). ``profile=True`` also measures the draft / verify / other split with per-phase jitted
    calls (one host sync per phase per round), on a further run under the same controller.
    """
    controller = RunToEnd() if controller is None else controller
    check_policies(draft_policy, verify_policy, controller)
    draft_config = draft_policy.draft_model_config(target_config)
    check_compatible(target_config, draft_config)
    tokens, lengths = prompt_tokens if prompt_tokens is not None else pad_prompts(prompts)
    bad = [int(t) for t in np.unique(tokens) if not 0 <= t < target_config.vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {target_config.vocab_size})")
    gamma = engine.gamma
    needed = int(lengths.max()) + engine.max_new_tokens + gamma + 2
    capacity = backend_of(target_config).round_capacity(capacity or needed)  # what init_cache allocates
    check_room(lengths, capacity, engine.max_new_tokens + gamma + 2,
               f"prompt + {engine.max_new_tokens} new tokens + a draft of gamma={gamma} (+2 headroom)")
    if not allow_beyond_context:
        check_context(target_config, lengths, engine.max_new_tokens)
    if prefilled is not None:
        cache = prefilled[0]
        if cache.capacity != capacity or cache.batch_size != len(lengths):
            raise ValueError(f"prefilled cache has capacity {cache.capacity} and batch {cache.batch_size}; this run "
                             f"needs {capacity} and {len(lengths)}")
        if not np.array_equal(np.asarray(cache.lengths), lengths):
            raise ValueError(f"prefilled cache lengths {np.asarray(cache.lengths).tolist()} differ from the prompt "
                             f"lengths {lengths.tolist()}")
    explicit_mesh = mesh is not None
    target_params, mesh, rules = resolve_placement(target_params, target_config, mesh, rules)
    if mesh is not None and draft_params is not None and (explicit_mesh or mesh_of(draft_params) is None):
        draft_params = shard_params(draft_params, draft_config, mesh, draft_rules or rules)
    draft_params = target_params if draft_params is None else draft_params

    def initial_state():
        return prefill_loop_state(target_params, target_config, tokens, lengths, capacity, draft_policy=draft_policy,
                                  draft_params=draft_params, draft_state=draft_state, verify_policy=verify_policy,
                                  verify_state=verify_state, engine=engine, seed=seed, mesh=mesh, rules=rules,
                                  prefilled=prefilled, prefill_target=getattr(controller, "prefill_target", None))

    static = dict(target_config=target_config, draft_policy=draft_policy, verify_policy=verify_policy, engine=engine)
    engines = {gamma: engine}

    def engine_for(g: int) -> EngineConfig:
        if g not in engines:
            engines[g] = dataclasses.replace(engine, gamma=g)
        return engines[g]

    def run_chunk(live: LiveRun, chunk: Chunk, profile_totals=None) -> None:
        start = time.perf_counter()
        run_chunk_body(live, chunk, profile_totals)
        seconds = time.perf_counter() - start  # each chunk ends in a host read of its results: synced
        live.counters.chunk_log.append(("plain", int(chunk.plain_steps), seconds) if chunk.plain_steps is not None
                                       else ("rounds", int(live.last_chunk), seconds))

    def run_chunk_body(live: LiveRun, chunk: Chunk, profile_totals=None) -> None:
        state = live.state
        if chunk.draft_state is not None:
            state = state._replace(draft_state=placed(chunk.draft_state))
        if chunk.plain_steps is not None:
            steps = int(chunk.plain_steps)
            if steps > engine.max_new_tokens:
                raise ValueError(f"Chunk plain_steps={steps} exceeds max_new_tokens={engine.max_new_tokens}")
            if live.plain_from is None:  # the draft cache misses what plain decoding commits from here on
                live.plain_from = tuple(jnp.copy(x) for x in (state.previous, state.num_out, state.committed))
            if chunk.keep_states:  # its own compile: the states buffer is sized for this stretch alone
                first = state.committed - 1
                state, count, states = plain_decode(target_params, state, jnp.int32(steps), config=target_config,
                                                    engine=engine, steps=steps, keep_states=True)
                live.kept_states = (states, first, count)
            else:
                state, count = plain_decode(target_params, state, jnp.int32(steps), config=target_config,
                                            engine=engine, steps=engine.max_new_tokens)
            live.counters.plain_steps += steps
            live.counters.plain_tokens += int(jnp.sum(count))
            live.state, live.last_chunk = state, steps
            return
        g = gamma if chunk.gamma is None else int(chunk.gamma)
        if g > gamma:
            raise ValueError(f"Chunk gamma={g} exceeds the engine's gamma={gamma} (the loop state is sized for it)")
        if g + 1 != state.accepted_histogram.shape[0]:  # fold the gamma-sized counters into the host totals
            live.counters.fold(state)
            state = state._replace(accepted_histogram=placed(jnp.zeros((g + 1,), jnp.int32)),
                                   draft_counts=None if state.draft_counts is None else placed(init_draft_counts(g)))
        live.counters.gammas_used.add(g)
        before = int(state.round)
        chunk_static = dict(static, engine=engine_for(g))
        if chunk.draft_policy is not None:
            chunk_static["draft_policy"] = chunk.draft_policy
            live.counters.draft_policies.add(chunk.draft_policy)
        if live.plain_from is not None:  # the first speculative rounds after plain decoding
            previous, num_out, committed = live.plain_from
            live.plain_from = None
            # (no host sync for a draft that reads the target cache: nothing to catch up)
            grown = int(jnp.max(state.committed - committed)) if has_own_cache(chunk_static["draft_policy"]) else 0
            if grown > 0:
                steps = 1 << max(3, (grown - 1).bit_length())  # powers of two from 8: few compiles
                state = catch_up(draft_params, state, previous, num_out, committed,
                                 draft_policy=chunk_static["draft_policy"], steps=steps)
                live.counters.catch_ups += 1
        if profile_totals is None:
            state = run_loop(target_params, draft_params, state, max_rounds=chunk.rounds, **chunk_static)
        else:
            seconds, state = _profile(target_params, draft_params, state, chunk_static, max_rounds=chunk.rounds,
                                      skip_first=g not in profile_totals["compiled"])
            profile_totals["compiled"].add(g)
            for k, v in seconds.items():
                profile_totals[k] = profile_totals.get(k, 0) + v
        live.state, live.last_chunk = state, int(state.round) - before

    passes = [0]  # runs so far (the first of a warmup=True pair is the warm-up)

    def execute(profile_totals=None):
        start = time.perf_counter()
        state = initial_state()
        jax.block_until_ready(state)
        live = LiveRun(target_params, target_config, engine, tokens, lengths, capacity, state, RunCounters(gamma),
                       warmup=warmup and passes[0] == 0 and profile_totals is None,
                       profiling=profile_totals is not None)
        live.timings["prefill_s"] = time.perf_counter() - start
        live.decode_start = time.perf_counter()
        controller.start(live)
        while (chunk := controller.next_chunk(live)) is not None:
            run_chunk(live, chunk, profile_totals)
        jax.block_until_ready(live.state)
        live.timings["decode_s"] = time.perf_counter() - live.decode_start
        return live

    def run():
        live = execute()
        passes[0] += 1
        extra_metrics, extra_timings = controller.finish(live)
        return (live, extra_metrics), dict(live.timings) | dict(extra_timings)

    with use_mesh(mesh):
        (live, extra_metrics), timings = run_with_warmup(run, warmup)
        final = live.state
        out = np.asarray(final.out)[:, : engine.max_new_tokens]
        num_generated = (out != PAD_OUTPUT).sum(axis=1)
        counters = live.counters
        counters.fold(final)
        merged = final._replace(accepted_histogram=counters.histogram, draft_counts=None if final.draft_counts is None
                                else {"drafted_histogram": counters.drafted_histogram, "attempts": counters.attempts})
        metrics = _metrics(merged, gamma, engine, plain_tokens=counters.plain_tokens) | dict(extra_metrics)
        if profile:
            totals = {"compiled": set(), "profile_draft_s": 0.0, "profile_verify_s": 0.0, "profile_other_s": 0.0,
                      "profile_rounds": 0}
            execute(totals)
            del totals["compiled"]
            timings.update(totals)
    return SpeculativeResult(tokens=out, num_generated=num_generated, prompt_lengths=np.asarray(lengths),
                             metrics=metrics, timings=timings, final_state=final)


def _metrics(final: LoopState, gamma: int, engine: EngineConfig, plain_tokens: int = 0) -> Dict[str, Any]:
    histogram = np.asarray(final.accepted_histogram, np.int64)
    row_rounds = int(np.asarray(final.active_rounds).sum())
    # tokens committed by rounds (the first generated token comes from the prefill; plain-decoding
    # stretches of a controller are not rounds)
    committed_in_rounds = int((np.asarray(final.num_out) - 1).sum()) - int(plain_tokens)
    reached = np.array([histogram[i:].sum() for i in range(gamma + 1)])  # rounds with >= i accepted
    attempts, drafted_tokens = reached[:gamma], histogram.sum() * gamma  # every round drafts gamma tokens
    counts = final.draft_counts
    extra = {}
    if counts is not None:  # only real drafts count (e.g. none after an early exit)
        drafted_histogram = np.asarray(counts["drafted_histogram"], np.int64)
        attempts = np.asarray(counts["attempts"], np.int64)
        drafted_tokens = int((drafted_histogram * np.arange(gamma + 1)).sum())
        extra = {"drafted_tokens": drafted_tokens, "drafted_histogram": drafted_histogram.tolist(),
                 "mean_drafted": drafted_tokens / max(int(drafted_histogram.sum()), 1)}
    per_position = [float(reached[i + 1] / attempts[i]) if attempts[i] else None for i in range(gamma)]
    return extra | {
        "rounds": int(final.round),
        "row_rounds": row_rounds,
        # rounds each row was active in: the loop runs until the row with the most is done
        "rounds_per_row": np.asarray(final.active_rounds).astype(int).tolist(),
        "tau": committed_in_rounds / row_rounds if row_rounds else None,
        "tau_untruncated": float((histogram * (np.arange(gamma + 1) + 1)).sum() / max(histogram.sum(), 1)),
        "accepted_histogram": histogram.tolist(),
        "acceptance_rate_per_position": per_position,  # P(d_i accepted | d_1..d_{i-1} accepted)
        "acceptance_rate": float((histogram * np.arange(gamma + 1)).sum() / max(drafted_tokens, 1)),
        "gamma": gamma,
        "fixed_acceptance": engine.fixed_acceptance,
        "acceptance_mode": "fixed (systems benchmark: tokens are not the model's output)"
        if engine.fixed_acceptance is not None else ("greedy" if engine.sampling.greedy else "rejection sampling"),
    }


def _profile(target_params, draft_params, state, static, max_rounds: Optional[int] = None,
             skip_first: bool = True) -> Tuple[Dict[str, float], LoopState]:
    """Draft / verify / other time from per-phase jitted calls (``skip_first``: the first round of each
    kind a round schedule has compiles and is not counted), and the final state; at most ``max_rounds`` rounds
    (None: to the end)."""
    engine = static["engine"]
    limit = engine.max_new_tokens if max_rounds is None else min(int(state.round) + int(max_rounds),
                                                                 engine.max_new_tokens)
    phase_static = {k: static[k] for k in ("target_config", "draft_policy", "engine")}
    policy = static["verify_policy"]
    period = int(getattr(policy, "round_period", 1))  # a round schedule: each kind its own program, as in the loop
    totals = {"draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0}
    rounds = 0
    to_skip = period if skip_first else 0  # the compile round of each kind
    while int(state.round) < limit and not bool(jnp.all(state.done)):
        verify_policy = policy if period == 1 else policy.at_phase(int(policy.round_phase(state.verify_state)))
        verify_static = {"target_config": static["target_config"], "verify_policy": verify_policy,
                         "engine": engine}
        t0 = time.perf_counter()
        proposal, key = draft_phase_jit(target_params, draft_params, state.draft_state, state.target_cache,
                                        state.pending, state.previous, state.committed, state.key,
                                        static["verify_policy"].draft_feedback(state.verify_state), **phase_static)
        jax.block_until_ready(proposal)
        t1 = time.perf_counter()
        logits, cache, probes = verify_phase_jit(target_params, proposal.target_cache, state.verify_state,
                                            state.committed, state.pending, proposal.tokens, proposal.signals,
                                            skip_drafts_of(proposal, state.done, draft_policy=static["draft_policy"],
                                                           verify_policy=verify_policy, engine=engine),
                                            **verify_static)
        jax.block_until_ready(logits)
        t2 = time.perf_counter()
        before = state._replace(target_cache=None, draft_state=None)
        state = commit_phase_jit(before, proposal._replace(target_cache=None), logits, cache, key, engine=engine)
        state = update_verify_state_jit(before, state, probes, verify_policy=static["verify_policy"])
        jax.block_until_ready(state)
        t3 = time.perf_counter()
        if to_skip:  # compile round
            to_skip -= 1
            continue
        totals["draft_s"] += t1 - t0
        totals["verify_s"] += t2 - t1
        totals["other_s"] += t3 - t2
        rounds += 1
    return {f"profile_{k}": v for k, v in totals.items()} | {"profile_rounds": rounds}, state
