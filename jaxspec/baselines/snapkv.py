"""SnapKV verification: a static prompt selection made once after prefill (docs/methods.md §3.6).

SnapKV (Li et al. 2024; official ``snapkv_utils.py``), per layer and KV head: the last
``window`` (32) prompt tokens are the *observation window*; their attention probabilities
(softmax over the whole prompt, causal inside the window) are summed over the window queries
on every prefix position ``[0, L - window)``, smoothed by a 1-D average pool (kernel 7, zero
padding ``kernel // 2``, padded zeros counted: ``F.avg_pool1d`` defaults), and the top
``budget - window`` prefix positions plus the window itself are kept. A prompt with
``L <= budget`` is kept whole.

**Choice (engine contract): one set per sequence.** The engine's verify policy returns one
index set per sequence shared by all layers and KV heads, so the per-head scores are
aggregated: the selection score of a position is the sum over *all layers and all query heads*
of the pooled window attention (each head's window rows sum to at most ``window``, so every
head weighs the same; pooling is linear, so sum-then-pool equals pool-then-sum). The top
``budget - window`` prefix positions by that score (ties: lower position) plus the window are
kept -- the same exact top-k as :func:`jaxspec.dustin.selection.select_top_k`, which does it.

After prefill the prompt selection is fixed; every generated token is kept (the window grows):
the verify set of a round is ``prompt selection + positions L .. committed - 2``. Shapes are
static, so the generated part has room for ``max_generated`` positions; beyond that only the
most recent ``max_generated`` generated positions are kept (set it >= ``max_new_tokens`` for
the SnapKV rule exactly).

Usage. The selection needs the target's observation-window queries, so it runs once after the
prompt is in the target cache: the engine's verify-policy ``prefill`` hook (called when no
``verify_state`` is given) re-runs the last ``window`` prompt tokens over the prefilled cache
(a ``window``-token forward, inside the engine's prefill time)::

    policy = SnapKVVerify(target_config, budget=1024, max_generated=engine.max_new_tokens)
    speculative_generate(..., verify_policy=policy)

or, outside the engine, ``state = policy.prepare(target_params, target_config, tokens, lengths)``
(prefills the prompts itself unless given the cache) and ``verify_state=state``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import prefill
from jaxspec.decoding.contract import VerifyPolicyBase
from jaxspec.dustin.selection import select_top_k
from jaxspec.models.cache import KVCache, init_cache
from jaxspec.models.llama import forward


def average_pool(scores: jax.Array, valid: jax.Array, kernel: int) -> jax.Array:
    """``avg_pool1d(kernel, stride 1, padding kernel // 2, count_include_pad=True)`` of ``scores
    [B, S]`` over each row's valid prefix (``valid [B, S]`` True on a prefix); zero elsewhere."""
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel {kernel} must be odd and >= 1 (same-length output)")
    x = jnp.where(valid, scores, 0.0)
    half = kernel // 2
    padded = jnp.pad(x, ((0, 0), (half, half)))
    seq = x.shape[1]
    total = sum(padded[:, o:o + seq] for o in range(kernel))
    return jnp.where(valid, total / kernel, 0.0)


def _window_scores_fn(params, tokens, cache: KVCache, prompt_lengths, *, config: ModelConfig, window: int,
                      kernel: int):
    """Pooled observation-window attention ``[B, S]`` summed over layers and query heads.

    ``cache`` holds the prefilled prompt (``lengths == prompt_lengths``); ``tokens [B, T]`` the
    right-padded prompts. Rows shorter than ``window`` have no prefix (all zeros).
    """
    batch, total = tokens.shape
    obs = min(window, total)
    lengths = prompt_lengths.astype(jnp.int32)
    start = jnp.maximum(lengths - obs, 0)  # first observation position (= prefix length)
    pos = start[:, None] + jnp.arange(obs, dtype=jnp.int32)[None, :]  # [B, W]
    query_valid = pos < lengths[:, None]  # rows shorter than obs: padded queries
    win_tokens = jnp.take_along_axis(tokens, jnp.clip(pos, 0, total - 1), axis=1)
    heads = config.num_heads
    probe = tuple((layer, head) for layer in range(config.num_layers) for head in range(heads))
    # re-run the window over the prefix cache: its queries (post-RoPE) and, in the returned cache,
    # the window's own keys at positions start .. start + W - 1
    out = forward(params, win_tokens, cache.with_lengths(start), config=config, probe_heads=probe)
    queries = out.probes.queries  # [B, L * Hq, W, D] float32
    capacity = cache.capacity
    key_pos = jnp.arange(capacity, dtype=jnp.int32)
    visible = key_pos[None, None, :] <= pos[:, :, None]  # [B, W, S] causal over prefix + window
    prefix = key_pos[None, :] < start[:, None]  # [B, S]
    scale = 1.0 / np.sqrt(config.head_dim)
    groups = config.queries_per_kv
    summed = jnp.zeros((batch, capacity), jnp.float32)
    for layer in range(config.num_layers):
        q = queries[:, layer * heads:(layer + 1) * heads]  # [B, Hq, W, D], head h = kv * G + g
        q = q.reshape(batch, config.num_kv_heads, groups, obs, -1)
        keys = out.cache.keys[layer].astype(jnp.float32)  # [B, Hkv, S, D]
        scores = jnp.einsum("bkgwd,bksd->bkgws", q, keys) * scale
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(query_valid[:, None, None, :, None], probs, 0.0)
        summed = summed + jnp.sum(probs, axis=(1, 2, 3))
    return average_pool(summed, prefix, kernel)


_window_scores = jax.jit(_window_scores_fn, static_argnames=("config", "window", "kernel"))


def snapkv_scores(params, config: ModelConfig, tokens, prompt_lengths, cache: KVCache, *, window: int = 32,
                  kernel: int = 7) -> jax.Array:
    """SnapKV selection scores ``[B, S]`` (zero outside each row's prefix ``[0, L - window)``)."""
    return _window_scores(params, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(prompt_lengths, jnp.int32),
                          config=config, window=window, kernel=kernel)


def snapkv_select(scores: jax.Array, prompt_lengths, *, budget: int, window: int = 32) -> jax.Array:
    """Prompt index set ``[B, budget]`` (sorted, -1 padding): the last ``window`` prompt positions
    plus the top ``budget - window`` prefix positions by ``scores`` (ties: lower position); the whole
    prompt when ``L <= budget``."""
    if not 1 <= window <= budget:
        raise ValueError(f"window={window} must be in [1, budget={budget}]")
    if scores.shape[1] < budget:  # select_top_k needs k <= S; the extra positions are invalid
        scores = jnp.pad(scores, ((0, 0), (0, budget - scores.shape[1])))
    return select_top_k(scores, jnp.asarray(prompt_lengths, jnp.int32), k=budget, sinks=0, window=window)


@dataclasses.dataclass(frozen=True)
class SnapKVVerify(VerifyPolicyBase):
    """Verify policy: static SnapKV prompt selection + every generated position. ``config`` (the
    target's) is needed only by the engine's ``prefill`` hook."""

    config: Optional[ModelConfig] = None
    budget: int = 1024  # prompt positions kept, observation window included
    window: int = 32
    kernel: int = 7
    max_generated: int = 1024  # static room for generated positions (>= max_new_tokens: exact rule)
    name: str = "snapkv"

    def __post_init__(self):
        if not 1 <= self.window <= self.budget:
            raise ValueError(f"window={self.window} must be in [1, budget={self.budget}]")
        if self.max_generated < 1:
            raise ValueError(f"max_generated={self.max_generated} must be >= 1")

    def prepare(self, target_params, target_config: ModelConfig, tokens, prompt_lengths,
                cache: Optional[KVCache] = None) -> dict:
        """Verify state ``{"prompt_indices": [B, budget], "prompt_lengths": [B]}`` for right-padded
        ``tokens [B, T]``. ``cache``: the target cache already holding exactly the prompts (else one
        is prefilled here)."""
        tokens = np.asarray(tokens, np.int32)
        lengths = np.asarray(prompt_lengths, np.int32)
        if cache is None:
            cache = init_cache(target_config, tokens.shape[0], max(tokens.shape[1], 1))
            cache, _ = prefill(target_params, target_config, tokens, lengths, cache)
        elif not np.array_equal(np.asarray(cache.lengths), lengths):
            raise ValueError("the given cache must hold exactly the prompts (lengths == prompt_lengths)")
        scores = snapkv_scores(target_params, target_config, tokens, lengths, cache, window=self.window,
                               kernel=self.kernel)
        indices = snapkv_select(scores, lengths, budget=self.budget, window=self.window)
        return {"prompt_indices": indices, "prompt_lengths": jnp.asarray(lengths)}

    def prefill(self, target_params, target_cache, tokens, prompt_lengths) -> dict:
        """The engine's verify-policy hook: ``target_cache`` holds exactly the prompts."""
        if self.config is None:
            raise ValueError("SnapKVVerify needs the target config for the engine's prefill hook: "
                             "SnapKVVerify(target_config, ...), or pass verify_state=policy.prepare(...)")
        return self.prepare(target_params, self.config, tokens, prompt_lengths, cache=target_cache)

    def verify_indices(self, state, target_cache, committed, signals):
        lengths = state["prompt_lengths"]
        history = committed - 1  # positions 0 .. committed - 2 are in the verified history
        generated = history - lengths
        first = lengths + jnp.maximum(generated - self.max_generated, 0)
        gen = first[:, None] + jnp.arange(self.max_generated, dtype=jnp.int32)[None, :]
        gen = jnp.where(gen < history[:, None], gen, -1)
        return jnp.concatenate([state["prompt_indices"], gen], axis=1).astype(jnp.int32)
