"""KnapSpec's draft policy: the target with a skip mask, early exit, a dynamic gamma cap (docs/methods.md §4.4).

The engine contract is :mod:`jaxspec.decoding.policies`; :mod:`jaxspec.knapspec.policy` gives the overview."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.contract import DraftPolicyBase
from jaxspec.decoding.policies import Proposal
from jaxspec.decoding.sampling import SamplingConfig, sample_token, sampling_probs
from jaxspec.knapspec.budgeted import BUDGET, DENSE, SKIP, budgeted_forward, check_budget
from jaxspec.models.llama import forward


#: ``gamma_cap`` meaning "no cap" (the engine's gamma)
NO_GAMMA_CAP = 2 ** 30


@dataclasses.dataclass(frozen=True)
class KnapSpecDraft(DraftPolicyBase):
    """Self-draft with a dynamic ``[L, 2]`` skip mask and early exit (see :mod:`jaxspec.knapspec.policy`)."""

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
