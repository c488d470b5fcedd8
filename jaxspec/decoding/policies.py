"""The stock draft and verify policies of the speculative engine, and skip-set helpers.

The contract they implement (:class:`~jaxspec.decoding.contract.DraftPolicy`,
:class:`~jaxspec.decoding.contract.VerifyPolicy`, :class:`~jaxspec.decoding.contract.Proposal`)
lives in :mod:`jaxspec.decoding.contract`; every policy here derives from its base classes.

* :class:`SeparateDraft` -- a separate (smaller) draft model with its own KV cache;
* :class:`SelfDraft` -- the target with a ``[L, 2]`` skip mask, drafting into the target cache;
* :class:`DenseVerify` -- verification attends to the whole history.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.contract import DraftPolicyBase, Proposal, VerifyPolicyBase
from jaxspec.decoding.sampling import SamplingConfig, sample_token, sampling_probs
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward
from jaxspec.models.sharding import placement_of


def draft_loop(step_fn, first_logits, state, gamma: int, sampling: SamplingConfig, key):
    """Sample ``gamma`` tokens: ``first_logits [B, V]`` gives token 1; ``step_fn(state, token)``
    returns (logits, state) for each next one."""
    keys = jax.random.split(key, gamma)
    token = sample_token(first_logits, keys[0], sampling)
    probs0 = None if sampling.greedy else sampling_probs(first_logits, sampling)

    def body(carry, step_key):
        state, token = carry
        logits, state = step_fn(state, token)
        new = sample_token(logits, step_key, sampling)
        probs = None if sampling.greedy else sampling_probs(logits, sampling)
        return (state, new), (new, probs)

    (state, _), (rest, rest_probs) = jax.lax.scan(body, (state, token), keys[1:])
    tokens = jnp.concatenate([token[:, None], rest.T], axis=1) if gamma > 1 else token[:, None]
    probs = None
    if not sampling.greedy:
        probs = probs0[:, None] if gamma == 1 else jnp.concatenate([probs0[:, None], rest_probs.transpose(1, 0, 2)], 1)
    return tokens, probs, state


def catch_up_cache(draft_params, config: ModelConfig, cache, tokens, start):
    """A separate draft's cache after plain decoding (:meth:`DraftPolicyBase.catch_up`): one dense
    forward of the draft over ``tokens [B, S]`` at positions ``start [B] ..``, as its prefill (the K/V
    only; slots past the capacity are dropped). Without it the K/V of the plainly decoded tokens
    would be missing from the draft cache for the rest of the run, lowering acceptance."""
    return forward(draft_params, tokens, cache.with_lengths(start), config=config).cache


@dataclasses.dataclass(frozen=True)
class SeparateDraft(DraftPolicyBase):
    """A separate (smaller) draft model with its own KV cache.

    Each round the draft cache is rolled back to ``committed - 2`` and the first draft forward
    takes two tokens, ``[previous, pending]``: rewriting ``previous`` is idempotent, and it
    covers the round where every draft token was accepted (the last draft token was never fed
    to the draft). No separate catch-up step, no per-row branching.
    """

    config: ModelConfig
    name: str = "draft-model"

    def draft_model_config(self, target_config):
        return self.config

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        from jaxspec.decoding.autoregressive import prefill

        mesh, rules = placement_of(draft_params)  # on a mesh, the draft cache is sharded like its weights
        cache = init_cache(self.config, tokens.shape[0], capacity, mesh=mesh, rules=rules)
        cache, _ = prefill(draft_params, self.config, tokens, prompt_lengths, cache)
        return cache

    def catch_up(self, draft_params, state, tokens, start):
        return catch_up_cache(draft_params, self.config, state, tokens, start)

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key):
        cache = state.with_lengths(committed - 2)
        out = forward(draft_params, jnp.stack([previous, pending], axis=1), cache, config=self.config)

        def step(cache, token):
            result = forward(draft_params, token[:, None], cache, config=self.config)
            return result.logits[:, 0], result.cache

        tokens, probs, cache = draft_loop(step, out.logits[:, 1], out.cache, gamma, sampling, key)
        return Proposal(tokens, probs, cache, target_cache)


@dataclasses.dataclass(frozen=True)
class SelfDraft(DraftPolicyBase):
    """The target itself with some sub-layers skipped (``state`` holds the ``[L, 2]`` mask, so a
    planner can change it between rounds without a recompile). Reads the target's KV cache and
    writes its draft KV (executed layers only) beyond the committed length."""

    config: ModelConfig
    name: str = "self-draft"

    def initial_state(self, skip_mask) -> dict:
        mask = jnp.asarray(skip_mask, bool)
        if mask.shape != (self.config.num_layers, 2):
            raise ValueError(f"skip mask shape {mask.shape}; expected ({self.config.num_layers}, 2)")
        return {"skip_mask": mask}

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        raise TypeError("SelfDraft has no cache of its own: build its state with initial_state(skip_mask)")

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key):
        mask = state["skip_mask"]
        cache = target_cache.with_lengths(committed - 1)
        out = forward(draft_params, pending[:, None], cache, config=self.config, skip_mask=mask)

        def step(cache, token):
            result = forward(draft_params, token[:, None], cache, config=self.config, skip_mask=mask)
            return result.logits[:, 0], result.cache

        tokens, probs, cache = draft_loop(step, out.logits[:, 0], out.cache, gamma, sampling, key)
        return Proposal(tokens, probs, state, cache)


@dataclasses.dataclass(frozen=True)
class DenseVerify(VerifyPolicyBase):
    """Verification attends to the whole history (every default of the base)."""

    name: str = "dense"


# ---------------------------------------------------------------------------- skip specs
_SKIP_ITEM = re.compile(r"^(attn|attention|mlp|layer|layers):(.+)$")


def parse_skip_spec(spec: str, num_layers: int) -> np.ndarray:
    """Parse a skip set into a ``[L, 2]`` bool mask (column 0 Attention, column 1 MLP).

    Grammar: items separated by ``;``, each ``KIND:LAYERS`` with KIND ``attn``, ``mlp`` or
    ``layer`` (both sub-layers) and LAYERS a comma list of ``N``, ``N-M`` (inclusive), ``odd``,
    ``even`` or ``all``. Example: ``"mlp:odd"`` (every other layer's MLP),
    ``"attn:4-9;mlp:12,14"``.
    """
    mask = np.zeros((num_layers, 2), bool)
    if not spec or not spec.strip():
        raise ValueError("empty skip spec; example: 'mlp:odd' or 'attn:4-9;mlp:12,14'")
    for item in spec.replace(" ", "").split(";"):
        match = _SKIP_ITEM.match(item)
        if not match:
            raise ValueError(f"bad skip item {item!r} in {spec!r}; expected KIND:LAYERS with KIND attn, mlp or layer")
        kind, layers = match.groups()
        columns = {"attn": [0], "attention": [0], "mlp": [1], "layer": [0, 1], "layers": [0, 1]}[kind]
        chosen = set()
        for part in layers.split(","):
            if part == "all":
                chosen.update(range(num_layers))
            elif part == "odd":
                chosen.update(range(1, num_layers, 2))
            elif part == "even":
                chosen.update(range(0, num_layers, 2))
            elif re.fullmatch(r"\d+-\d+", part):
                lo, hi = map(int, part.split("-"))
                chosen.update(range(lo, hi + 1))
            elif part.isdigit():
                chosen.add(int(part))
            else:
                raise ValueError(f"bad layer list {layers!r} in {spec!r}; use N, N-M, odd, even or all")
        bad = sorted(i for i in chosen if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"layers {bad} out of range in skip spec {spec!r}; the model has layers 0..{num_layers - 1}")
        for i in chosen:
            mask[i, columns] = True
    return mask


def describe_skip_mask(mask) -> str:
    mask = np.asarray(mask, bool)
    attn = np.nonzero(mask[:, 0])[0].tolist()
    mlp = np.nonzero(mask[:, 1])[0].tolist()
    return f"{len(attn)} attention {attn}, {len(mlp)} MLP {mlp}"
