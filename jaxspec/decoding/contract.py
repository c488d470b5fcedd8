"""The engine contract: what a draft policy, a verify policy and a controller provide.

:func:`~jaxspec.decoding.speculative.speculative_generate` runs rounds of *draft* (a
:class:`DraftPolicy` proposes ``gamma`` tokens), *verify* (the target scores ``gamma + 1`` rows
under a :class:`VerifyPolicy`) and *commit* (acceptance, rollback by setting cache lengths),
all rounds of a chunk in one jitted ``lax.while_loop``. A host-side :class:`Controller` decides
the chunks. The engine calls only the methods below; it never probes a policy for optional
hooks and never names a method (Dustin, KnapSpec, the baselines bring their own policies and
controllers). The base classes :class:`DraftPolicyBase`, :class:`VerifyPolicyBase` and
:class:`ControllerBase` carry the defaults, so a new policy writes only what it changes; see
``docs/extending.md`` for a worked example.

Policies are frozen (hashable) dataclasses: static arguments of the jitted loop. Their arrays
live in ``state`` pytrees the engine threads through the rounds. Sequence bookkeeping shared
by every policy: ``committed [B]`` counts each row's committed tokens (prompt + generated); the
last one, ``pending [B]``, is not yet in the target cache (it is the first of the ``gamma + 1``
verified rows); ``previous [B]`` is the one before it.
"""

from __future__ import annotations

import abc

import dataclasses
from typing import Any, Dict, NamedTuple, Optional, Protocol, Tuple, runtime_checkable

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models.cache import KVCache
from jaxspec.models.llama import ForwardOutput, forward


class Proposal(NamedTuple):
    """What a draft policy returns each round."""

    tokens: jax.Array  # [B, gamma] int32
    probs: Optional[jax.Array]  # [B, gamma, V] float32: the distributions the tokens were drawn from (None when greedy)
    state: Any  # the next draft state
    target_cache: KVCache  # the target cache (a self-draft writes its KV beyond committed - 1; verification overwrites)
    signals: Any = None  # anything the verify policy wants (e.g. Dustin's lookahead attention)
    # [B] int32: real drafted tokens per row (the rest of ``tokens`` are fillers, never accepted nor
    # counted as drafted); None = all ``gamma``
    num_drafted: Optional[jax.Array] = None


# ---------------------------------------------------------------------------- draft policies
@runtime_checkable
class DraftPolicy(Protocol):
    """Proposes ``gamma`` tokens per round."""

    def draft_model_config(self, target_config: ModelConfig) -> ModelConfig:
        """The config of the model that drafts (its vocabulary must be the target's; a separate draft
        is placed on the target's mesh with it)."""

    def prefill(self, draft_params, tokens: jax.Array, prompt_lengths, capacity: int) -> Any:
        """Host level, once per run when no ``draft_state`` is given: the initial draft state for the
        right-padded prompts ``tokens [B, T]`` (``prompt_lengths [B]``), room for ``capacity`` tokens."""

    def propose(self, draft_params, state, target_cache: KVCache, pending, previous, committed, *, gamma: int,
                sampling: SamplingConfig, key) -> Proposal:
        """Traced, every round: draft ``gamma`` (static) tokens after ``pending``. When the verify
        policy's :meth:`VerifyPolicy.draft_feedback` is not ``None``, the engine also passes it as
        ``feedback=`` (only drafts meant to pair with such a verify policy take it)."""


class DraftPolicyBase(abc.ABC):
    """Defaults of :class:`DraftPolicy`: the target's config, a stateless prefill (``None``).
    ``propose`` has no default: a subclass without it cannot be instantiated."""

    #: whether a round's ``Proposal.num_drafted`` can be 0 for every row (e.g. prompt lookup without a
    #: match): the engine then compiles the one-row verification for such rounds (docs/methods.md §5.8)
    can_draft_nothing: bool = False

    def draft_model_config(self, target_config: ModelConfig) -> ModelConfig:
        return target_config

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        return None

    @abc.abstractmethod
    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key):
        """See :meth:`DraftPolicy.propose`."""

    def catch_up(self, draft_params, state, tokens, start):
        """Traced, before the first speculative round after plain decoding: ``tokens [B, S]`` are the
        tokens at positions ``start [B] ..`` that plain decoding committed (padded past each row's
        count with tokens whose K/V a later round overwrites before reading). A draft with a cache of
        its own writes their K/V there (the plain steps ran the target only); the default, a draft
        that reads the target cache or keeps no cache, returns ``state`` unchanged."""
        return state


# ---------------------------------------------------------------------------- verify policies
@runtime_checkable
class VerifyPolicy(Protocol):
    """Chooses what the verification attends to, and keeps state across rounds."""

    @property
    def probe_heads(self) -> Tuple[Tuple[int, int], ...]:
        """Static ``((layer, query_head), ...)`` probed in the verification forward (``probes`` of
        :meth:`update`); ``()`` for none."""

    def prefill(self, target_params, target_cache: KVCache, tokens, prompt_lengths) -> Any:
        """Host level, once per run when no ``verify_state`` is given (``target_cache`` holds the prompts)."""

    def verify_indices(self, state, target_cache: KVCache, committed, signals) -> Optional[jax.Array]:
        """History positions ``[B, K]`` int32 (``-1`` padded) the verification attends to, or ``None`` (dense)."""

    def verify_forward(self, target_params, rows, target_cache: KVCache, committed, signals, *,
                       config: ModelConfig, state) -> ForwardOutput:
        """The verification forward of ``rows [B, gamma + 1]`` (``[pending, d_1 .. d_gamma]``) written at
        ``committed - 1 ..``; ``target_cache`` is the cache after drafting (its lengths may be past
        ``committed - 1`` where a self-draft wrote). Returns logits ``[B, gamma + 1, V]``, the cache and
        the probes of :attr:`probe_heads`."""

    def update(self, state, probes, num_committed, committed) -> Any:
        """Traced, after each commit: the next state (``num_committed [B]``: tokens committed this
        round, 0 for finished rows; verification row ``num_committed - 1`` is the last one now in the
        target cache)."""

    def draft_feedback(self, state) -> Any:
        """Traced, before each draft: what of the verify state the draft sees (``propose(...,
        feedback=)``), e.g. the last round's verified positions for a draft that attends to the same
        ones (docs/methods.md §5, "sparse draft KV"); ``None`` (the default): nothing, and ``propose``
        gets no ``feedback`` argument."""


class VerifyPolicyBase:
    """Defaults of :class:`VerifyPolicy`: dense, stateless, nothing probed, the model's forward."""

    @property
    def probe_heads(self) -> Tuple[Tuple[int, int], ...]:
        return ()

    def prefill(self, target_params, target_cache, tokens, prompt_lengths):
        return None

    def verify_indices(self, state, target_cache, committed, signals):
        return None

    def verify_forward(self, target_params, rows, target_cache, committed, signals, *, config, state,
                       write_cache: bool = True):
        """``write_cache=False``: the new K/V come back in ``ForwardOutput.new_kv`` unwritten (the engine's
        one-row verification writes them after its conditional, docs/methods.md §5.8)."""
        indices = self.verify_indices(state, target_cache, committed, signals)
        return forward(target_params, rows, target_cache.with_lengths(committed - 1), config=config,
                       verify_indices=indices, probe_heads=tuple(self.probe_heads), write_cache=write_cache)

    def update(self, state, probes, num_committed, committed):
        return state

    def draft_feedback(self, state):
        return None

    # A round schedule (docs/methods.md §3.7): a policy whose rounds repeat a fixed cycle of ``round_period``
    # kinds (e.g. Dustin's coverage rule deciding every m_every-th round) lets the loop run a whole cycle per
    # iteration, round j compiled as ``at_phase(j)``, with no conditional choosing the kind on the device.
    round_period = 1

    def round_phase(self, state):
        """The kind (``0 .. round_period - 1``, traced int32) of the next round, from the verify state."""
        return jnp.zeros((), jnp.int32)

    def at_phase(self, phase: int):
        """This policy with round kind ``phase`` fixed at compile time (hashable, compared by value)."""
        return self


# ---------------------------------------------------------------------------- controllers
@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stretch of a run, chosen by a :class:`Controller`.

    * ``rounds``: speculative rounds, all in one jitted ``while_loop`` (``None``: until every row
      finishes; fewer when they do); a traced bound, so no recompile per value;
    * ``plain_steps``: instead, this many plain autoregressive steps on the same cache, in one
      dispatch (no draft, no verification; the verify policy's ``update`` is not called); rows
      that finish stop committing;
    * ``gamma``: the engine gamma of these rounds (verification rows - 1), ``1 .. EngineConfig.gamma``
      (``None``: ``EngineConfig.gamma``); each value is one compile of the loop. The loop state's
      acceptance counters are gamma-sized: the engine folds them into its host totals at a change;
    * ``draft_state``: replace the draft state before the chunk (e.g. a new skip plan); ``None``: keep;
    * ``draft_policy``: run these rounds with this draft policy instead of the run's (e.g. one compiled
      for a skip plan); it reads and writes the run's draft state. A static argument of the loop: each
      distinct policy (hashable, compared by value) is one compile, which jit keeps; ``None``: the run's;
    * ``keep_states`` (with ``plain_steps``): the plain steps also keep the target's residual stream of every
      token they feed, at every sub-layer boundary (``LiveRun.kept_states``; a KnapSpec plan on those tokens
      then runs no forward of its own for them, docs/methods.md §5.6). One compile per stretch length.
    """

    rounds: Optional[int] = None
    plain_steps: Optional[int] = None
    gamma: Optional[int] = None
    draft_state: Any = None
    draft_policy: Any = None
    keep_states: bool = False

    def __post_init__(self):
        if self.rounds is not None and int(self.rounds) < 0:
            raise ValueError(f"Chunk rounds={self.rounds} must be >= 0 or None (to the end)")
        if self.plain_steps is not None and int(self.plain_steps) < 1:
            raise ValueError(f"Chunk plain_steps={self.plain_steps} must be >= 1 or None (speculative rounds)")
        if self.keep_states and self.plain_steps is None:
            raise ValueError("Chunk keep_states=True keeps the states of plain steps: give plain_steps too")
        if self.gamma is not None and int(self.gamma) < 1:
            raise ValueError(f"Chunk gamma={self.gamma} must be >= 1 or None (the engine's gamma)")
        if self.draft_policy is not None and not isinstance(self.draft_policy, DraftPolicy):
            raise TypeError(f"Chunk draft_policy {type(self.draft_policy).__name__} is not a DraftPolicy; derive it "
                            f"from jaxspec.decoding.contract.DraftPolicyBase")
        if self.draft_policy is not None and self.plain_steps is not None:
            raise ValueError("Chunk draft_policy applies to speculative rounds; plain_steps run no draft")


@runtime_checkable
class Controller(Protocol):
    """Host-side hook of :func:`~jaxspec.decoding.speculative.speculative_generate`, called between
    chunks of rounds. ``run`` is the live :class:`~jaxspec.decoding.speculative.LiveRun` (loop state,
    committed tokens, counters, the prompt, the target params); a controller must not donate or
    keep its arrays across runs. The same controller object runs the warm-up run and the timed run
    (``run.warmup`` tells which) and the ``profile=True`` pass: :meth:`start` resets it.

    Optional: a method ``prefill_target(target_params, target_config, tokens, lengths, cache) -> (cache,
    first_logits)`` replaces the engine's prefill of the target
    (:func:`~jaxspec.decoding.autoregressive.prefill`, same arguments and results) in every run the
    engine prefills (not with ``prefilled``); KnapSpec's keeps the last prompt tokens' states there."""

    def start(self, run) -> None:
        """Before the first chunk of a run (after the prefill)."""

    def next_chunk(self, run) -> Optional[Chunk]:
        """The next chunk, or ``None``: the run ends."""

    def finish(self, run) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """After the last chunk of the timed run: ``(metrics, timings)`` added to the result's."""


class ControllerBase:
    """Defaults of :class:`Controller`: nothing to reset, nothing to add; :meth:`next_chunk` runs every
    round in one dispatch (the engine's default)."""

    def start(self, run) -> None:
        self._done = False

    def next_chunk(self, run) -> Optional[Chunk]:
        if self._done:
            return None
        self._done = True
        return Chunk()

    def finish(self, run) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        return {}, {}


class RunToEnd(ControllerBase):
    """The default controller: all rounds in one jitted ``while_loop`` (one dispatch)."""


class ScriptedController(ControllerBase):
    """A controller written as a generator: :meth:`chunks` yields chunks; after each ``yield`` the engine
    has run it and ``run.state`` / ``run.last_chunk`` describe the result. Convenient for drivers with
    their own schedule (KnapSpec's re-planning)."""

    def chunks(self, run):
        yield Chunk()

    def start(self, run) -> None:
        self._chunks = self.chunks(run)

    def next_chunk(self, run) -> Optional[Chunk]:
        return next(self._chunks, None)


def check_policies(draft_policy, verify_policy, controller) -> None:
    """A clear ``TypeError`` when a policy or the controller does not implement its protocol."""
    for value, protocol, base in ((draft_policy, DraftPolicy, "DraftPolicyBase"),
                                  (verify_policy, VerifyPolicy, "VerifyPolicyBase"),
                                  (controller, Controller, "ControllerBase")):
        if not isinstance(value, protocol):
            methods = sorted(name for name in dir(protocol) if not name.startswith("_"))
            raise TypeError(f"{type(value).__name__} is not a {protocol.__name__} (it needs {', '.join(methods)}); "
                            f"derive it from jaxspec.decoding.contract.{base}")


__all__ = ["Chunk", "Controller", "ControllerBase", "DraftPolicy", "DraftPolicyBase", "Proposal", "RunToEnd",
           "ScriptedController", "VerifyPolicy", "VerifyPolicyBase", "check_policies"]
