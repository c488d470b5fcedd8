"""Token choice: greedy, temperature and nucleus (top-p) sampling.

``SamplingConfig`` is static (hashable); ``temperature == 0`` means greedy. The same
``sampling_probs`` feeds rejection sampling in the speculative engine, so the distribution the
autoregressive sampler draws from and the one speculative decoding must preserve are one
function.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_probs(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """The distribution a token is drawn from: softmax(logits / T) restricted to the top-p nucleus.

    ``logits [..., V]`` float32 -> probabilities ``[..., V]`` float32. Greedy gives a one-hot.
    """
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    probs = jax.nn.softmax(logits / sampling.temperature, axis=-1)
    if sampling.top_p < 1.0:
        sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
        cumulative = jnp.cumsum(sorted_probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p: a token is kept if the mass before it < top_p
        keep_sorted = (cumulative - sorted_probs) < sampling.top_p
        threshold = jnp.min(jnp.where(keep_sorted, sorted_probs, jnp.inf), axis=-1, keepdims=True)
        probs = jnp.where(probs >= threshold, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample_token(logits: jax.Array, key: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Draw one token per row. ``logits [B, V]`` -> ``[B]`` int32."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = sampling_probs(logits, sampling)
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
