"""Batched autoregressive decoding with ragged prompts: chunked prefill + one jit-compiled loop.

Prompts of different lengths share a batch: they are right-padded, prefilled together (each
row's cache length is then set to its own prompt length, so padding is never attended), and
decoded in one ``lax.while_loop`` that stops when every row has emitted a stop token or the
token limit. No host round-trip per token.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.sampling import SamplingConfig, sample_token
from jaxspec.models.cache import KVCache, check_context, check_room, init_cache
from jaxspec.models.llama import forward
from jaxspec.models.sharding import ACTIVATION_AXES, constrain, resolve_placement, use_mesh

PAD_OUTPUT = -1  # marks positions after a row stopped


@dataclasses.dataclass
class GenerationResult:
    tokens: np.ndarray  # [B, N] int32, PAD_OUTPUT after the row stopped
    num_generated: np.ndarray  # [B]
    prompt_lengths: np.ndarray  # [B]
    timings: Dict[str, float]

    def rows(self) -> List[List[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.num_generated)]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens (all rows) per second of decoding (prefill and compile excluded)."""
        return float(self.num_generated.sum()) / max(self.timings["decode_s"], 1e-9)


class CompileCounter:
    """Counts XLA compiles (a persistent-cache hit included: it is still traced, lowered and loaded) while
    entered, from JAX's ``backend_compile_duration`` monitoring event: ``count`` and ``seconds``."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def _listen(self, event, duration, **_):
        if event == self.EVENT:
            self.count += 1
            self.seconds += float(duration)

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)
        return False


def run_with_warmup(run, warmup: bool):
    """``run() -> (result, timings)``; with ``warmup`` run twice and keep the second (steady-state)
    timings, reporting the first call's extra time as ``compile_s``, and the compiles the timed run still
    made as ``timed_compiles`` / ``timed_compile_s`` (0 when the warm-up compiled everything the timed run
    ran; a run whose choices depend on timing may take a path the warm-up did not)."""
    start = time.perf_counter()
    result, timings = run()
    if warmup:
        first_total = time.perf_counter() - start
        del result  # the warm-up's result (a run's caches, say) goes before the timed run allocates its own
        with CompileCounter() as compiles:
            result, timings = run()
        timings["compile_s"] = max(first_total - timings["prefill_s"] - timings["decode_s"], 0.0)
        timings["timed_compiles"], timings["timed_compile_s"] = compiles.count, compiles.seconds
    return result, timings


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into ``[B, T_max]`` int32 and return them with their lengths."""
    if not prompts:
        raise ValueError("no prompts given")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"every prompt needs at least one token; lengths {lengths.tolist()}")
    tokens = np.full((len(prompts), int(lengths.max())), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = np.asarray(prompt, np.int32)
    return tokens, lengths


def choose_prefill_chunk(config: ModelConfig, batch: int, capacity: int, prompt_len: int,
                         score_bytes_budget: int = 512 << 20) -> int:
    """Largest power-of-two chunk whose float32 score tensor ``[B, Hq, C, S + C]`` fits the budget."""
    chunk = 16
    while chunk < 2048 and chunk < prompt_len and batch * config.num_heads * (2 * chunk) * (
            capacity + 2 * chunk) * 4 <= score_bytes_budget:
        chunk *= 2
    return chunk


def _prefill_chunk_fn(params, tokens, cache, last_index, *, config):
    """One prefill chunk; returns the new cache and the logits at ``last_index [B]`` (clipped)."""
    steps = tokens.shape[1]
    where = jnp.clip(last_index, 0, steps - 1)[:, None]
    out = forward(params, tokens, cache, config=config, output_positions=where)
    return out.cache, out.logits[:, 0]


_prefill_chunk = jax.jit(_prefill_chunk_fn, static_argnames=("config",), donate_argnames=("cache",))


def prefill(params, config: ModelConfig, tokens: np.ndarray, prompt_lengths: np.ndarray, cache: KVCache,
            chunk: Optional[int] = None) -> Tuple[KVCache, jax.Array]:
    """Write right-padded prompts ``[B, T]`` into an empty ``cache`` chunk by chunk.

    Returns the cache with ``lengths = start lengths + prompt_lengths`` and the logits ``[B, V]``
    at each row's last prompt token. Raises :class:`CacheOverflowError` before writing anything
    if a row's prompt does not fit.
    """
    batch, total = tokens.shape
    # rows may already hold tokens (a continued prompt): each row needs room for its own prompt
    held = np.asarray(jax.device_get(cache.lengths))
    check_room(held + np.asarray(prompt_lengths), cache.capacity, 0, "prefill")
    chunk = chunk or choose_prefill_chunk(config, batch, cache.capacity, total)
    padded = int(np.ceil(total / chunk) * chunk)
    tokens = np.pad(tokens, ((0, 0), (0, padded - total)))
    last = jnp.asarray(np.asarray(prompt_lengths) - 1, jnp.int32)
    start_lengths = jnp.asarray(held)  # a copy: the cache buffers are donated below
    # the lengths as a fresh host-made array: a cache returned by another jitted call carries committed
    # lengths, and jit's cache keys on committedness (an identical-shape recompile per continued prompt)
    cache = cache.with_lengths(jnp.asarray(held))
    last_logits = None
    for start in range(0, padded, chunk):
        cache, logits = _prefill_chunk(params, jnp.asarray(tokens[:, start:start + chunk]), cache,
                                       last - start, config=config)
        in_chunk = ((last >= start) & (last < start + chunk))[:, None]
        # also on the first chunk: a one-chunk prompt then builds the same small programs as a longer one
        last_logits = jnp.where(in_chunk, logits, logits if last_logits is None else last_logits)
    return cache.with_lengths(start_lengths + jnp.asarray(prompt_lengths, jnp.int32)), last_logits


def decode_steps(params, cache, token, done, out, key, start, end, *, config, sampling, stop_tokens,
                 skip_finished: bool = True, states=None):
    """The decode ``while_loop``: from step ``start`` while ``step < end`` (traced) and some row is not done,
    feed ``token [B]``, sample the next and write it to ``out[:, step]`` (``PAD_OUTPUT`` for done rows).
    ``skip_finished``: done rows read none of their history (:attr:`KVCache.frozen`, docs/methods.md §5.7).
    The cache is carried as given (a donated buffer stays in place). Returns ``(out, cache)``.
    ``states [2L + 1, B, S, H]``: also keep each step's residual stream at every sub-layer boundary
    (``forward(..., return_states=True)``) in column ``step`` (the fed token's; docs/methods.md §5.6) and
    return ``(out, cache, states)``."""
    stop = jnp.asarray(stop_tokens if stop_tokens else (-2,), jnp.int32)
    keep = states is not None

    def cond(state):
        step, done = state[0], state[4]
        return (step < end) & ~jnp.all(done)

    def body(state):
        step, cache, out, token, done, key = state[:6]
        result = forward(params, token[:, None], cache.with_frozen(done) if skip_finished else cache, config=config,
                         return_states=keep)
        key, sub = jax.random.split(key)
        new = sample_token(result.logits[:, 0], sub, sampling)
        new = jnp.where(done, PAD_OUTPUT, new)
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, step))
        done = done | jnp.isin(new, stop)
        carry = (step + 1, result.cache.with_frozen(None), out, jnp.maximum(new, 0), done, key)
        if keep:
            carry += (jax.lax.dynamic_update_slice_in_dim(state[6], result.states.astype(state[6].dtype), step,
                                                          axis=2),)
        return carry

    state = (jnp.int32(start), cache, out, token, done, key) + ((states,) if keep else ())
    final = jax.lax.while_loop(cond, body, state)
    return (final[2], final[1], final[6]) if keep else (final[2], final[1])


def decode_loop_fn(params, cache, first_logits, key, *, config, sampling, max_new_tokens, stop_tokens):
    """``max_new_tokens`` (static) tokens: the first sampled from ``first_logits``, the rest by
    :func:`decode_steps`."""
    batch = cache.batch_size
    stop = jnp.asarray(stop_tokens if stop_tokens else (-2,), jnp.int32)
    key, sub = jax.random.split(key)
    token = sample_token(first_logits, sub, sampling)
    out = jnp.full((batch, max_new_tokens), PAD_OUTPUT, jnp.int32).at[:, 0].set(token)
    out = constrain(out, ACTIVATION_AXES["output_tokens"])  # under a mesh: replicated, host-readable
    return decode_steps(params, cache, token, jnp.isin(token, stop), out, key, 1, max_new_tokens, config=config,
                        sampling=sampling, stop_tokens=stop_tokens)


decode_loop = jax.jit(decode_loop_fn, static_argnames=("config", "sampling", "max_new_tokens", "stop_tokens"),
                       donate_argnames=("cache",))


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (), seed: int = 0,
             capacity: Optional[int] = None, headroom: int = 0, prefill_chunk: Optional[int] = None,
             warmup: bool = False, mesh=None, rules=None, allow_beyond_context: bool = False) -> GenerationResult:
    """Decode ``max_new_tokens`` tokens after each prompt (a batch of ragged token lists).

    ``capacity`` defaults to the longest prompt + ``max_new_tokens`` + ``headroom``. With
    ``warmup=True`` the compiled loop runs once before the timed run, so ``timings`` hold
    steady-state numbers (``compile_s`` reports the first call).

    Multi-device: params placed with ``jaxspec.models.sharding.shard_params`` are used where they
    are (the cache is allocated sharded like them); or pass ``mesh`` (and ``rules``) to place
    them here. The number of prompts must divide by the mesh's ``data`` axis.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    tokens, lengths = pad_prompts(prompts)
    bad = [int(t) for t in np.unique(tokens) if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {config.vocab_size})")
    needed = int(lengths.max()) + max_new_tokens + headroom
    capacity = needed if capacity is None else capacity
    check_room(lengths, capacity, max_new_tokens + headroom, "prompt + generation")
    if not allow_beyond_context:
        check_context(config, lengths, max_new_tokens)
    stop_tokens = tuple(sorted({int(t) for t in stop_tokens}))
    params, mesh, rules = resolve_placement(params, config, mesh, rules)

    def run():
        timings = {}
        cache = init_cache(config, len(prompts), capacity, mesh=mesh, rules=rules)
        start = time.perf_counter()
        cache, first_logits = prefill(params, config, tokens, lengths, cache, prefill_chunk)
        first_logits.block_until_ready()
        timings["prefill_s"] = time.perf_counter() - start
        start = time.perf_counter()
        out, _ = decode_loop(params, cache, first_logits, jax.random.PRNGKey(seed), config=config,
                              sampling=sampling, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens)
        out = np.asarray(out)
        timings["decode_s"] = time.perf_counter() - start
        return out, timings

    with use_mesh(mesh):
        out, timings = run_with_warmup(run, warmup)
    num_generated = (out != PAD_OUTPUT).sum(axis=1)
    return GenerationResult(tokens=out, num_generated=num_generated, prompt_lengths=lengths, timings=timings)
