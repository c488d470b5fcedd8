"""Prompt lookup (n-gram) drafting: speculative decoding without a draft model.

The method Hugging Face ships as ``prompt_lookup_num_tokens`` and vLLM as its n-gram
speculator (Saxena 2023, "Prompt Lookup Decoding"): for each row, match the last ``n`` committed
tokens (``n`` from ``max_ngram`` down to ``min_ngram``, the longest that matches wins) against the
row's earlier committed tokens (prompt and generated) and propose the tokens that followed the
earliest occurrence (as Hugging Face does), at most ``gamma``, never past the committed ones.
A row without a match drafts nothing that round (``num_drafted = 0``: the round is one target
step). The draft is deterministic, so its distribution is one-hot: rejection sampling then
accepts ``d`` with probability ``p(d)`` and resamples from ``p`` without ``d``, which keeps the
target distribution.

:class:`PromptLookupDraft` is a plain :class:`~jaxspec.decoding.contract.DraftPolicy`: its state
``{"history": [B, C] int32}`` holds each row's committed tokens (``C`` the cache capacity).
``prefill`` copies the prompts into it; each ``propose`` writes ``pending`` at ``committed - 1``,
matches, and writes its proposal at ``committed ..`` so that the drafts the engine accepts are
already in place next round (positions ``>= committed`` are never read). Vectorised over rows and
positions, ragged, jittable; the state follows speculative rounds only (a controller's
plain-decoding stretch would leave it behind).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.contract import DraftPolicyBase, Proposal


def ngram_lookup(history, committed, *, gamma: int, max_ngram: int, min_ngram: int):
    """Proposals from ``history [B, C]`` whose first ``committed [B]`` tokens are each row's
    committed ones: ``(tokens [B, gamma] int32, num_drafted [B] int32)``; ``tokens`` beyond
    ``num_drafted`` are fillers (0)."""
    batch, capacity = history.shape
    found = jnp.zeros((batch,), bool)
    start = jnp.zeros((batch,), jnp.int32)  # where the proposed continuation starts
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= capacity:
            continue
        # suffix [B, n]: positions committed - n .. committed - 1 (clipped; rows with fewer tokens never match)
        offsets = jnp.arange(n, dtype=jnp.int32)
        suffix = jnp.take_along_axis(history, jnp.clip(committed[:, None] - n + offsets[None, :], 0, capacity - 1), 1)
        windows = capacity - n + 1  # candidate starts j = 0 .. C - n
        match = jnp.ones((batch, windows), bool)
        for i in range(n):
            match &= history[:, i: i + windows] == suffix[:, i: i + 1]
        j = jnp.arange(windows, dtype=jnp.int32)[None, :]
        # an earlier occurrence: its continuation starts at j + n <= committed - 1 (the suffix itself excluded)
        match &= (j + n <= committed[:, None] - 1) & (committed[:, None] >= n + 1)
        has = match.any(axis=1)
        first = jnp.argmax(match, axis=1).astype(jnp.int32) + n  # the earliest occurrence
        start = jnp.where(found, start, first)
        found = found | has
    num_drafted = jnp.where(found, jnp.minimum(committed - start, gamma), 0).astype(jnp.int32)
    positions = start[:, None] + jnp.arange(gamma, dtype=jnp.int32)[None, :]
    tokens = jnp.take_along_axis(history, jnp.clip(positions, 0, capacity - 1), axis=1)
    tokens = jnp.where(jnp.arange(gamma)[None, :] < num_drafted[:, None], tokens, 0)
    return tokens.astype(jnp.int32), num_drafted


@dataclasses.dataclass(frozen=True)
class PromptLookupDraft(DraftPolicyBase):
    """Prompt lookup drafting (see the module docstring). ``vocab_size``: the target's (the
    one-hot draft distributions of rejection sampling)."""

    vocab_size: int
    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "prompt-lookup"
    can_draft_nothing = True  # a row without a match drafts nothing (a class attribute, not a field)

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({self.min_ngram}) <= max_ngram ({self.max_ngram})")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 1")

    def prefill(self, draft_params, tokens, prompt_lengths, capacity):
        tokens = jnp.asarray(tokens, jnp.int32)
        history = jnp.zeros((tokens.shape[0], capacity), jnp.int32).at[:, : tokens.shape[1]].set(tokens)
        return {"history": history}

    def propose(self, draft_params, state, target_cache, pending, previous, committed, *, gamma, sampling, key):
        rows = jnp.arange(pending.shape[0])
        history = state["history"].at[rows, committed - 1].set(pending, mode="drop")
        tokens, num_drafted = ngram_lookup(history, committed, gamma=gamma, max_ngram=self.max_ngram,
                                           min_ngram=self.min_ngram)
        # the proposal goes in now: the drafts the engine accepts are then already in place
        slots = committed[:, None] + jnp.arange(gamma, dtype=jnp.int32)[None, :]
        history = history.at[rows[:, None], slots].set(tokens, mode="drop")
        probs = None if sampling.greedy else jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        return Proposal(tokens, probs, {"history": history}, target_cache, num_drafted=num_drafted)


__all__ = ["PromptLookupDraft", "ngram_lookup"]
