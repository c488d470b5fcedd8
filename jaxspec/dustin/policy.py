"""Dustin as engine policies (the contract of :mod:`jaxspec.decoding.policies`).

* :class:`DustinDraft` -- :class:`~jaxspec.decoding.policies.SeparateDraft` that also probes the
  draft SRH heads: ``Proposal.signals`` is a :class:`~jaxspec.dustin.signals.DraftSignals` with
  the queries ``[B, P, gamma, D]`` of the gamma drafting steps (the forwards of ``pending,
  d_1 .. d_{gamma-1}``, the steps that produce ``d_1 .. d_gamma``; no extra forward) and the
  draft's key caches of the SRH layers.
* :class:`DustinSelfDraft` -- the same for a self-draft (:class:`SelfDraft`): the draft SRH
  layers are target layers the skip mask executes, their history keys the target cache's.
* :class:`DustinVerify` -- the verify policy. Each round it computes ``s_T`` from the query
  of the last committed token (kept in its state), ``s_D`` from the draft signals, and selects
  ``I_verify`` (:mod:`jaxspec.dustin.selection`). It asks the engine for the target SRH queries
  of the verification (``probe_heads``) and keeps, in ``update``, the one of the last token
  now in the target cache; ``prefill`` computes it for the last prompt token (docs/methods.md §3.1).

Dustin-T (``mode="target"``) works with any draft policy (no signals needed); Dustin-H and
Dustin-D need one of the Dustin drafts above. ``speculative_generate`` calls ``prefill`` itself
when no ``verify_state`` is given; with ``loop_state_from_caches`` pass
``verify_state=policy.prefill(target_params, cache, tokens, lengths)`` (``cache`` holding the prompts).

Cost notes: the probed forwards also return the probe heads' history probabilities (unused
here; on the XLA path a slice of what attention computes anyway, on the Pallas path one extra
``[P, rows, S]`` score pass per probed head).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.contract import VerifyPolicyBase
from jaxspec.decoding.policies import Proposal, SelfDraft, SeparateDraft, draft_loop
from jaxspec.dustin.config import DustinConfig
from jaxspec.dustin.selection import reuse_verify_indices, select_for_config, select_held, select_scheduled
from jaxspec.dustin.signals import DraftSignals, draft_signal, target_signal
from jaxspec.models.llama import forward


def _probe_heads(layers, heads) -> Tuple[Tuple[int, int], ...]:
    return tuple((int(layer), int(h)) for layer, hs in zip(layers, heads) for h in hs)


def draft_history_indices(draft_kv: str, lengths, *, sinks: int, window: int, feedback=None):
    """The cache slots ``[B, K]`` a draft forward over a cache of ``lengths [B]`` valid positions attends
    to (docs/methods.md §5, "sparse draft KV"), or ``None`` (``"full"``: all of them). Both sparse views
    are a fixed part plus the last ``window`` positions; slots of the fixed part inside the window (or
    negative) are dropped (``-1``), so no slot repeats:

    * ``"streaming"``: the sinks ``0 .. sinks-1`` -- the StreamingLLM set of
      ``jaxspec.baselines.streaming.streaming_indices`` (MagicDec's view), in another slot order;
    * ``"verify-set"``: ``feedback [B, K_v]``, the previous round's ``I_verify`` (target cache slots; a
      separate draft's cache holds the same tokens at the same slots), then the window (the tokens
      committed since, and the draft's own recent context).
    """
    if draft_kv == "full":
        return None
    n = jnp.asarray(lengths, jnp.int32)[:, None]
    if draft_kv == "streaming":
        fixed = jnp.broadcast_to(jnp.arange(sinks, dtype=jnp.int32)[None, :], (n.shape[0], sinks))
    elif draft_kv == "verify-set":
        if feedback is None:
            raise TypeError("draft_kv='verify-set' needs the verify policy's I_verify as feedback: pair the draft "
                            "with DustinVerify of the same config (dustin_policies)")
        fixed = jnp.asarray(feedback, jnp.int32)
    else:
        raise ValueError(f"draft_kv={draft_kv!r}; valid: full, streaming, verify-set")
    start = n - window
    recent = start + jnp.arange(window, dtype=jnp.int32)[None, :]
    recent = jnp.where(recent >= 0, recent, -1)
    fixed = jnp.where((fixed >= 0) & (fixed < start), fixed, -1)
    return jnp.concatenate([fixed, recent], axis=1)


def _drafting_queries(first, step_forward, first_logits_row, cache, gamma, sampling, key):
    """Run the draft loop collecting the probe queries of every drafting step (none when the forwards
    probe no head: then ``queries`` is ``None``).

    ``first``: the probes of the first draft forward (its last row is ``pending``);
    ``step_forward(cache, token) -> ForwardOutput``.
    """
    if first.probes is None:
        def plain(cache, token):
            result = step_forward(cache, token)
            return result.logits[:, 0], result.cache

        tokens, probs, cache = draft_loop(plain, first.logits[:, first_logits_row], cache, gamma, sampling, key)
        return tokens, probs, cache, None
    q0 = first.probes.queries[:, :, first_logits_row]  # [B, P, D]
    batch, heads, dim = q0.shape
    buffer = jnp.zeros((batch, heads, gamma, dim), jnp.float32).at[:, :, 0].set(q0)

    def step(carry, token):
        cache, buffer, index = carry
        result = step_forward(cache, token)
        buffer = jax.lax.dynamic_update_slice(buffer, result.probes.queries[:, :, :1], (0, 0, index, 0))
        return result.logits[:, 0], (result.cache, buffer, index + 1)

    tokens, probs, (cache, buffer, _) = draft_loop(step, first.logits[:, first_logits_row], (cache, buffer, 1),
                                                    gamma, sampling, key)
    return tokens, probs, cache, buffer


class _SparseDraftKV:
    """The draft-KV fields shared by :class:`DustinDraft` and :class:`DustinSelfDraft`
    (``DustinConfig.draft_kv`` / ``sinks`` / ``draft_window_size``)."""

    @property
    def probe_heads(self):
        return _probe_heads(self.layers, self.heads)

    def _forward(self, draft_params, tokens, cache, feedback, **options):
        """A draft forward: K/V written to the full cache, history attention restricted to
        :func:`draft_history_indices` of ``cache.lengths`` (one set for every new token)."""
        indices = draft_history_indices(self.draft_kv, cache.lengths, sinks=self.sinks, window=self.window,
                                        feedback=feedback)
        return forward(draft_params, tokens, cache, config=self.config, verify_indices=indices,
                       probe_heads=self.probe_heads, **options)

    def _signals(self, queries, cache):
        if queries is None:
            return None
        # s_D over the SRH layers' full history (docs/methods.md §5): the keys of the whole draft cache
        return DraftSignals(queries=queries, keys=tuple(cache.keys[layer] for layer in self.layers))


def _draft_kv_fields(dustin: DustinConfig) -> dict:
    return dict(draft_kv=dustin.draft_kv, sinks=dustin.sinks, window=dustin.draft_window_size)


@dataclasses.dataclass(frozen=True)
class DustinDraft(_SparseDraftKV, SeparateDraft):
    """A separate draft model that returns Dustin's lookahead signals (see the module doc); with
    ``draft_kv`` other than ``"full"`` its attention reads a budget of its cache (docs/methods.md §5)."""

    name: str = "dustin-draft"
    layers: Tuple[int, ...] = ()
    heads: Tuple[Tuple[int, ...], ...] = ()
    draft_kv: str = "full"
    sinks: int = 4
    window: int = 0

    @classmethod
    def from_config(cls, draft_config: ModelConfig, dustin: DustinConfig) -> "DustinDraft":
        dustin.check_models(draft_config=draft_config)
        return cls(config=draft_config, layers=dustin.draft_layers, heads=dustin.draft_heads,
                   **_draft_kv_fields(dustin))

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key,
                feedback=None):
        # the [previous, pending] first step shares one index set (as MagicDecDraft): the window ends at the
        # cached history, so pending also sees previous
        cache = state.with_lengths(committed - 2)
        first = self._forward(draft_params, jnp.stack([previous, pending], axis=1), cache, feedback)

        def step_forward(cache, token):
            return self._forward(draft_params, token[:, None], cache, feedback)

        tokens, probs, cache, queries = _drafting_queries(first, step_forward, 1, first.cache, gamma, sampling, key)
        return Proposal(tokens, probs, cache, target_cache, signals=self._signals(queries, cache))


@dataclasses.dataclass(frozen=True)
class DustinSelfDraft(_SparseDraftKV, SelfDraft):
    """A self-draft (the target with sub-layers skipped) that returns Dustin's lookahead signals.
    The draft SRH layers must be layers whose attention the skip mask executes. With ``draft_kv``
    other than ``"full"`` its attention reads a budget of the target cache (docs/methods.md §5)."""

    name: str = "dustin-self-draft"
    layers: Tuple[int, ...] = ()
    heads: Tuple[Tuple[int, ...], ...] = ()
    draft_kv: str = "full"
    sinks: int = 4
    window: int = 0

    @classmethod
    def from_config(cls, target_config: ModelConfig, dustin: DustinConfig) -> "DustinSelfDraft":
        dustin.check_models(draft_config=target_config)
        return cls(config=target_config, layers=dustin.draft_layers, heads=dustin.draft_heads,
                   **_draft_kv_fields(dustin))

    def initial_state(self, skip_mask=None) -> dict:
        """``{"skip_mask": [L, 2]}``; with ``skip_mask=None`` ``{}``: the whole target drafts (no
        sub-layer skipped and no mask traced), which with ``draft_kv`` other than ``"full"`` is the
        StreamingLLM / verify-set self-draft of docs/methods.md §5.1."""
        return {} if skip_mask is None else super().initial_state(skip_mask)

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        if self.draft_kv == "full":
            return super().prefill(draft_params, tokens, prompt_lengths, capacity)  # a mask is needed: refuse
        return {}  # the whole target over a budget of its own cache

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key,
                feedback=None):
        mask = state.get("skip_mask")
        cache = target_cache.with_lengths(committed - 1)
        first = self._forward(draft_params, pending[:, None], cache, feedback, skip_mask=mask)

        def step_forward(cache, token):
            return self._forward(draft_params, token[:, None], cache, feedback, skip_mask=mask)

        tokens, probs, cache, queries = _drafting_queries(first, step_forward, 0, first.cache, gamma, sampling, key)
        if "draft_steps" in state:  # a KnapSpec-driven state (knapspec_generate(draft_policy=...)) counts forwards
            state = dict(state, draft_steps=state["draft_steps"] + gamma)
        return Proposal(tokens, probs, state, cache, signals=self._signals(queries, cache))


class VerifiedProbes(NamedTuple):
    """:meth:`DustinVerify.verify_forward`'s probes with ``draft_kv="verify-set"``, ``reselect_every > 1`` or
    ``m_every > 1``:
    the forward's probes, this round's ``I_verify [B, k]`` and whether it was selected afresh this round
    (``fresh``, a bool scalar) at history lengths ``selected [B]``."""

    probes: Any
    indices: jax.Array
    fresh: Any = None
    selected: Any = None
    m_rows: Any = None  # ``m_every > 1``: each row's m this round (decided or held)


def last_prompt_query_fn(params, tokens, cache, *, config, probe_heads):
    return forward(params, tokens, cache, config=config, probe_heads=probe_heads).probes.queries[:, :, 0]


last_prompt_query = jax.jit(last_prompt_query_fn, static_argnames=("config", "probe_heads"))


@dataclasses.dataclass(frozen=True)
class DustinVerify(VerifyPolicyBase):
    """Sparse verification on ``I_verify`` chosen from Dustin's signals (see the module doc).

    ``draft_config``: the draft model's config (its GQA grouping scores ``s_D``); ``None`` for a
    self-draft (the target's). State: ``{"query": [B, P_T, D]}`` float32, the target SRH queries of
    the last committed token.
    """

    dustin: DustinConfig
    target_config: ModelConfig
    draft_config: Optional[ModelConfig] = None
    name: str = "dustin"
    # the round kind fixed at compile time (VerifyPolicyBase.at_phase): with m_every > 1 unrolled, 0 decides
    # and 1 .. m_every - 1 hold; None: the round reads its kind from the state (select_held's lax.cond)
    schedule_phase: Optional[int] = None

    def __post_init__(self):
        self.dustin.check_models(self.target_config, self.draft_config or self.target_config)

    @property
    def probe_heads(self) -> Tuple[Tuple[int, int], ...]:
        return self.dustin.target_probe_heads if self.dustin.uses_target_signal else ()

    @property
    def shares_verify_set(self) -> bool:
        """``draft_kv="verify-set"``: the state also keeps the last ``I_verify`` for the draft."""
        return self.dustin.draft_kv == "verify-set"

    @property
    def reuses_selection(self) -> bool:
        """``reselect_every > 1``: the state keeps the last fresh selection (docs/methods.md §3.8)."""
        return self.dustin.reselect_every > 1

    @property
    def holds_m(self) -> bool:
        """``m_every > 1``: the state keeps each row's m between the coverage rule's decisions (docs/methods.md
        §3.7)."""
        return self.dustin.m_every > 1 and self.dustin.input_aware

    @property
    def round_period(self) -> int:
        """``m_every`` where the decoding loop unrolls the held rule's cycle (``m_every_schedule="unrolled"``,
        docs/methods.md §3.7), else 1. A policy that also reuses selections (``reselect_every > 1``) decides
        in a round chosen on the device, so it keeps the conditional."""
        cfg = self.dustin
        unrolled = self.holds_m and cfg.m_every_schedule == "unrolled" and not self.reuses_selection
        return cfg.m_every if unrolled else 1

    def round_phase(self, state):
        if self.round_period == 1:
            return jnp.zeros((), jnp.int32)
        return (state["m_hold"]["since"] % self.round_period).astype(jnp.int32)

    def at_phase(self, phase: int):
        if self.round_period == 1:
            return self
        if not 0 <= int(phase) < self.round_period:
            raise ValueError(f"phase={phase} must lie in 0..{self.round_period - 1} (m_every={self.round_period})")
        return dataclasses.replace(self, schedule_phase=int(phase))

    def initial_hold_state(self, batch: int) -> dict:
        """``m_every > 1``: the state's ``"m_hold"`` before the first round (which decides): each row's m (the
        profile's to start) and the rounds so far."""
        return {"m": jnp.full((batch,), self.dustin.effective_m, jnp.int32), "since": jnp.zeros((), jnp.int32)}

    def initial_reuse_state(self, batch: int) -> dict:
        """``reselect_every > 1``: the state's ``"reuse"`` before the first round (nothing selected yet, so the
        first round selects)."""
        return {"indices": jnp.full((batch, self.dustin.budget), -1, jnp.int32),
                "selected": jnp.zeros((batch,), jnp.int32), "since": jnp.zeros((), jnp.int32)}

    def prefill(self, target_params, target_cache, tokens, prompt_lengths) -> dict:
        """The state after prefill: the target SRH queries of each row's last prompt token
        (a one-token forward that rewrites that token's K/V with the same values; the cache
        passed in is not modified); with ``draft_kv="verify-set"`` also ``"indices" [B, k]``, the
        StreamingLLM set (sinks + the last ``k - sinks``) of the prompt history, which the first
        round's draft reads in place of a previous ``I_verify``."""
        batch = target_cache.batch_size
        lengths = np.asarray(prompt_lengths, np.int32)
        state = {}
        if self.reuses_selection:
            state["reuse"] = self.initial_reuse_state(batch)
        if self.holds_m:
            state["m_hold"] = self.initial_hold_state(batch)
        if self.shares_verify_set:
            cfg = self.dustin
            state["indices"] = draft_history_indices("streaming", jnp.asarray(lengths - 1), sinks=cfg.sinks,
                                                     window=cfg.budget - cfg.sinks)
        if not self.probe_heads:
            return {"query": jnp.zeros((batch, 0, self.target_config.head_dim), jnp.float32), **state}
        last = np.asarray(tokens)[np.arange(batch), lengths - 1]
        return {"query": last_prompt_query(target_params, jnp.asarray(last[:, None], jnp.int32),
                                            target_cache.with_lengths(jnp.asarray(lengths - 1)),
                                            config=self.target_config, probe_heads=self.probe_heads), **state}

    def scores(self, state, target_cache, committed, signals):
        """``(s_D, s_T)`` ``[B, S]`` for this round (``None`` where the mode does not use one)."""
        cfg = self.dustin
        lengths = (committed - 1).astype(jnp.int32)
        s_target = s_draft = None
        if cfg.uses_target_signal:
            s_target = target_signal(state["query"], target_cache.keys[cfg.target_layer], lengths, cfg.target_heads,
                                     self.target_config.queries_per_kv, cfg.scoring_layout)
        if cfg.uses_draft_signal:
            if not isinstance(signals, DraftSignals):
                raise TypeError(f"DustinVerify(mode={cfg.mode!r}, m={cfg.effective_m}) needs the draft lookahead "
                                f"signal: use DustinDraft / DustinSelfDraft as the draft policy (got signals "
                                f"{type(signals).__name__})")
            draft_qpk = (self.draft_config or self.target_config).queries_per_kv
            s_draft = draft_signal(signals, lengths, cfg.draft_heads, draft_qpk, target_cache.capacity,
                                   cfg.scoring_layout)
        return s_draft, s_target

    def verify_indices(self, state, target_cache, committed, signals):
        return self._selection(state, target_cache, committed, signals)[0]

    def _selection(self, state, target_cache, committed, signals):
        """``(I_verify, m [B] or None)`` selected from this round's signals; with ``m_every > 1`` the coverage
        rule decides in every ``m_every``-th round and the held m selects in the others."""
        with jax.named_scope("selection"):  # a phase of the round's device trace (speculative.ROUND_PHASES)
            s_draft, s_target = self.scores(state, target_cache, committed, signals)
            if self.holds_m:
                hold = state["m_hold"]
                if self.schedule_phase is not None:  # the unrolled loop's round: its kind known when compiled
                    return select_scheduled(self.dustin, s_draft, s_target, committed - 1, hold["m"],
                                            decide=self.schedule_phase == 0)
                return select_held(self.dustin, s_draft, s_target, committed - 1, hold["m"],
                                   hold["since"] % self.dustin.m_every == 0)
            return select_for_config(self.dustin, s_draft, s_target, committed - 1), None

    def verify_forward(self, target_params, rows, target_cache, committed, signals, *, config, state):
        """The base class's forward; with ``draft_kv="verify-set"`` its probes also carry this round's
        ``I_verify`` (:class:`VerifiedProbes`), which :meth:`update` keeps for the next draft."""
        fresh = selected = m_rows = None
        if self.reuses_selection:
            cfg, reuse, lengths = self.dustin, state["reuse"], (committed - 1).astype(jnp.int32)
            # select every R-th round, and whenever a row's last selection was dense (history <= k): reusing
            # it would drop the positions its window has since left
            fresh = (reuse["since"] % cfg.reselect_every == 0) | jnp.any(reuse["selected"] <= cfg.budget)

            def select():  # with m_every > 1 also each row's m (a reusing round keeps the held one)
                indices, m = self._selection(state, target_cache, committed, signals)
                return (indices, m) if self.holds_m else indices

            def reuse_last():
                indices = reuse_verify_indices(reuse["indices"], reuse["selected"], lengths, sinks=cfg.sinks,
                                               window=cfg.window_size)
                return (indices, state["m_hold"]["m"]) if self.holds_m else indices

            chosen = jax.lax.cond(fresh, select, reuse_last)
            indices, m_rows = chosen if self.holds_m else (chosen, None)
            selected = jnp.where(fresh, lengths, reuse["selected"])
        else:
            indices, m_rows = self._selection(state, target_cache, committed, signals)
        result = forward(target_params, rows, target_cache.with_lengths(committed - 1), config=config,
                         verify_indices=indices, probe_heads=tuple(self.probe_heads))
        if not (self.shares_verify_set or self.reuses_selection or self.holds_m):
            return result
        return result._replace(probes=VerifiedProbes(result.probes, indices, fresh, selected, m_rows))

    def update(self, state, probes, num_committed, committed):
        extra = {}
        if self.shares_verify_set or self.reuses_selection or self.holds_m:
            probes, indices, fresh, selected, m_rows = (probes.probes, probes.indices, probes.fresh, probes.selected,
                                                        probes.m_rows)
        if self.holds_m:
            hold = state["m_hold"]
            # a row that committed nothing this round (finished) keeps its m; a round reusing its selection
            # (reselect_every) counts as a round but decides nothing
            extra["m_hold"] = {"m": jnp.where(num_committed > 0, m_rows, hold["m"]).astype(jnp.int32),
                               "since": (hold["since"] + 1).astype(jnp.int32)}
        if self.shares_verify_set:
            extra["indices"] = jnp.where((num_committed > 0)[:, None], indices, state["indices"])
        if self.reuses_selection:
            reuse = state["reuse"]
            extra["reuse"] = {"indices": jnp.where(fresh, indices, reuse["indices"]), "selected": selected,
                              "since": jnp.where(fresh, 1, reuse["since"] + 1).astype(jnp.int32)}
        if not self.probe_heads:
            return {**state, **extra}
        row = jnp.maximum(num_committed - 1, 0)[:, None, None, None]
        query = jnp.take_along_axis(probes.queries, row, axis=2)[:, :, 0]  # [B, P, D]
        return {"query": jnp.where((num_committed > 0)[:, None, None], query, state["query"]), **extra}

    def draft_feedback(self, state):
        """``draft_kv="verify-set"``: the last round's ``I_verify`` ``[B, k]`` (the draft attends to it)."""
        return state["indices"] if self.shares_verify_set else None


def dustin_policies(dustin: DustinConfig, target_config: ModelConfig, draft_config: Optional[ModelConfig] = None):
    """``(draft_policy, verify_policy)`` for a separate draft (``draft_config``) or, with
    ``draft_config=None``, a self-draft (give its state with ``SelfDraft.initial_state(mask)``)."""
    if draft_config is None:
        draft = DustinSelfDraft.from_config(target_config, dustin)
    else:
        draft = DustinDraft.from_config(draft_config, dustin)
    return draft, DustinVerify(dustin, target_config, draft_config)
