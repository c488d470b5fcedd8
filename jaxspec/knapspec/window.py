"""The reference window a plan runs on: its tokens (:func:`reference_window`), its target states from the
prefill (:func:`prefill_window`, docs/methods.md §5.6) and the rows a batch plan uses (:func:`planning_rows`,
:func:`cache_rows`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import prefill
from jaxspec.knapspec.dp import window_prefill


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
    head_cache = cache.with_lengths(jnp.asarray(head, jnp.int32))
    states, cache, logits = window_prefill(target_params, config, tail, head_cache, head, counts)
    return cache, logits, WindowStates(states, counts, lengths)


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
