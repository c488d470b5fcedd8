"""MagicDec: a draft that reads a StreamingLLM view of its KV cache; the target verifies densely.

Two draft policies for the engine (contract in :mod:`jaxspec.decoding.policies`); pair them with
``DenseVerify`` for MagicDec proper, or with a sparse verify policy (docs/methods.md §5, "sparse draft KV
combined with sparse verification", so neither side reads the full cache):

* :class:`MagicDecDraft` -- a separate draft model. Its cache keeps the whole history (prefilled
  densely, as MagicDec prefills with full attention and compresses afterwards) but every draft
  forward passes ``verify_indices = streaming_indices(cache.lengths, sinks, window)``: each
  draft query attends to the sinks, the ``window`` most recent cached positions and the tokens
  of its own forward. Positions keep their original RoPE. Reads per draft step are
  ``sinks + window`` (+ the new tokens), the same budget as the StreamingLLM verifier.
* :class:`MagicDecSelfDraft` -- the target itself as the draft, with StreamingLLM attention
  (ASSETS.md: 87-94 % greedy agreement for SmolLM2 at 4k with 4 sinks and a 256-1024 window).
  It reads the target cache and writes its draft KV beyond the committed length, where the
  verification overwrites it (like ``SelfDraft``). Optional ``skip_mask`` in its state
  combines it with layer skipping (KnapSpec-style).

The first draft forward of :class:`MagicDecDraft` (the engine's ``[previous, pending]`` two-token
step, see ``SeparateDraft``) shares one index set for both rows: the window ends at the cached
history, so ``previous`` sees exactly sinks + ``window`` recent positions (its rewrite stays
idempotent), and ``pending`` sees those plus ``previous``: ``window + 1`` recent tokens, one more
than StreamingLLM for that single query. ``exact_first_step=True`` instead runs the two tokens as
two one-token forwards (every draft query then sees exactly sinks + ``window`` + itself) at the
cost of one more draft forward per round. An exact single forward would need per-row index sets
(``verify_indices [B, T, K]``) in ``forward``.

Verification is dense, so greedy MagicDec always reproduces the target's greedy output, and
with ``sinks + window`` covering the whole history it is ClassicSD.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.baselines.streaming import check_sinks_window, streaming_indices
from jaxspec.config import ModelConfig
from jaxspec.decoding.contract import DraftPolicyBase
from jaxspec.decoding.policies import Proposal, SeparateDraft, catch_up_cache, draft_loop
from jaxspec.models.llama import forward


def _streaming_forward(params, tokens, cache, *, config, sinks, window, skip_mask=None):
    indices = streaming_indices(cache.lengths, sinks=sinks, window=window)
    return forward(params, tokens, cache, config=config, verify_indices=indices, skip_mask=skip_mask)


@dataclasses.dataclass(frozen=True)
class MagicDecDraft(DraftPolicyBase):
    """A separate draft model whose draft attention reads sinks + window of its (full) cache."""

    config: ModelConfig
    sinks: int = 4
    window: int = 1020
    exact_first_step: bool = False
    name: str = "magicdec"

    def __post_init__(self):
        check_sinks_window(self.sinks, self.window)

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    def draft_model_config(self, target_config):
        return self.config

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        # dense prefill of the whole prompt (MagicDec compresses after a full-attention prefill)
        return SeparateDraft(self.config).prefill(draft_params, tokens, prompt_lengths, capacity)

    def catch_up(self, draft_params, state, tokens, start):
        return catch_up_cache(draft_params, self.config, state, tokens, start)  # dense, as the prefill

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key):
        fwd = dict(config=self.config, sinks=self.sinks, window=self.window)
        cache = state.with_lengths(committed - 2)
        if self.exact_first_step:
            cache = _streaming_forward(draft_params, previous[:, None], cache, **fwd).cache
            out = _streaming_forward(draft_params, pending[:, None], cache, **fwd)
            first_logits = out.logits[:, 0]
        else:
            out = _streaming_forward(draft_params, jnp.stack([previous, pending], axis=1), cache, **fwd)
            first_logits = out.logits[:, 1]

        def step(cache, token):
            result = _streaming_forward(draft_params, token[:, None], cache, **fwd)
            return result.logits[:, 0], result.cache

        tokens, probs, cache = draft_loop(step, first_logits, out.cache, gamma, sampling, key)
        return Proposal(tokens, probs, cache, target_cache)


@dataclasses.dataclass(frozen=True)
class MagicDecSelfDraft(DraftPolicyBase):
    """The target with StreamingLLM attention (sinks + window of the target cache) as its own draft.

    ``state`` is a dict, ``{}`` or ``{"skip_mask": [L, 2] bool}`` (build it with
    :meth:`initial_state`, or let the engine call :meth:`prefill`, which returns ``{}``).
    """

    config: ModelConfig
    sinks: int = 4
    window: int = 1020
    name: str = "magicdec-self"

    def __post_init__(self):
        check_sinks_window(self.sinks, self.window)

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    def initial_state(self, skip_mask=None) -> dict:
        if skip_mask is None:
            return {}
        mask = jnp.asarray(skip_mask, bool)
        if mask.shape != (self.config.num_layers, 2):
            raise ValueError(f"skip mask shape {mask.shape}; expected ({self.config.num_layers}, 2)")
        return {"skip_mask": mask}

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        return {}  # no cache of its own: it reads the target cache

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key):
        fwd = dict(config=self.config, sinks=self.sinks, window=self.window, skip_mask=state.get("skip_mask"))
        cache = target_cache.with_lengths(committed - 1)
        out = _streaming_forward(draft_params, pending[:, None], cache, **fwd)

        def step(cache, token):
            result = _streaming_forward(draft_params, token[:, None], cache, **fwd)
            return result.logits[:, 0], result.cache

        tokens, probs, cache = draft_loop(step, out.logits[:, 0], out.cache, gamma, sampling, key)
        return Proposal(tokens, probs, state, cache)
