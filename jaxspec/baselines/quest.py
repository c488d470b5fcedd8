"""Quest verification: query-aware page selection per layer, query head and query row (docs/methods.md §3.6).

Quest (Tang et al. 2024; official ``quest_attention.py`` evaluation code), for one decode query
``q`` of one head at one layer:

* the keys are split into pages of ``page_size`` (16) consecutive positions from position 0;
* each page keeps per-channel bounds ``M = max_i K[i]`` and ``m = min_i K[i]`` over its (valid)
  keys; its score is ``sum_d max(q_d * M_d, q_d * m_d)`` -- an upper bound of ``q . k`` for every
  key ``k`` of the page (:func:`page_scores`);
* the top ``min(max(3, budget // page_size), #pages)`` pages are attended, the others masked
  (``min_pages`` = 3 as in the official code);
* the first ``dense_layers`` (2) layers attend densely.

Queries and keys are the post-RoPE ones; GQA: keys are shared by the query heads of a group
(the official code repeats the KV heads), each **query head** selects its own pages.

**Why a verification forward of its own.** A verify policy's ``verify_indices`` is *one* index
set per sequence for all layers and heads, computed before the verification forward -- but
Quest's set depends on the layer, the head and the query itself, and the queries of the
verified rows only exist inside the verification forward. Rather than approximating (e.g. one
union set from the previous round's queries), we implement the exact rule in a model-level
forward, :func:`quest_verify_forward` (the verify policy's ``verify_forward`` hook), built
from the model's building blocks layer by layer:
layers ``< dense_layers`` run ``attention_block`` densely; every later layer computes its
queries, scores the pages of the committed history with each verified row's own query (every
one of the ``gamma + 1`` rows is treated as a Quest decode query: its own top pages), and
attends to those pages plus the ``gamma + 1`` new tokens, causally among themselves (the
engine's rule for every verify policy; Quest's decode query likewise sees its own key).
Pages partition the committed history ``[0, committed - 1)``; the partial last page is bounded
over its valid keys only; padding is never attended. When the budget covers every history page
the forward equals the dense one.

The attention of a Quest layer is the dense jnp reference masked to the selected pages (like the
``xla`` backend of ``forward``), and the page bounds are recomputed from the cache in every
forward (Quest maintains them per page as keys arrive: the same values). Exact Quest numerics,
not Quest's speed: a paged sparse kernel reading only the bounds and the selected pages would
be needed for timings.

:func:`quest_speculative_generate` runs :func:`~jaxspec.decoding.speculative.speculative_generate`
with :class:`QuestVerify`, whose ``verify_forward`` (the engine's verify-forward hook) is
:func:`quest_verify_forward`: the engine's own draft and commit phases, all rounds in one
jitted ``while_loop``, mesh, ``profile=True`` and warm-up as for every method.
:class:`QuestVerify`'s ``verify_indices`` raises (it has no one-set-per-sequence form).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.contract import VerifyPolicyBase
from jaxspec.decoding.speculative import EngineConfig, SpeculativeResult, speculative_generate
from jaxspec.models.cache import KVCache
from jaxspec.models.attention import grouped_key_scores
from jaxspec.models.layers import decoder_layer, default_positions, embed, lm_head, rope_tables
from jaxspec.models.llama import ForwardOutput


# ---------------------------------------------------------------------------- page scores
def page_bounds(keys: jax.Array, lengths: jax.Array, page_size: int):
    """Per-page channel bounds of ``keys [B, H, S, D]`` over the valid positions ``< lengths [B]``.

    Returns ``(k_max, k_min) [B, H, P, D]`` float32 (``P = ceil(S / page_size)``; 0 on pages with
    no valid key) and ``page_valid [B, P]`` (the page holds at least one valid key).
    """
    batch, heads, seq, dim = keys.shape
    pages = -(-seq // page_size)
    pad = pages * page_size - seq
    keys = jnp.pad(keys.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    valid = jnp.arange(pages * page_size)[None, :] < lengths[:, None]  # [B, P * ps]
    v = valid[:, None, :, None]
    k_max = jnp.where(v, keys, -jnp.inf).reshape(batch, heads, pages, page_size, dim).max(axis=3)
    k_min = jnp.where(v, keys, jnp.inf).reshape(batch, heads, pages, page_size, dim).min(axis=3)
    page_valid = valid.reshape(batch, pages, page_size).any(axis=2)
    pv = page_valid[:, None, :, None]
    return jnp.where(pv, k_max, 0.0), jnp.where(pv, k_min, 0.0), page_valid


def page_scores(q: jax.Array, k_max: jax.Array, k_min: jax.Array, page_valid: jax.Array) -> jax.Array:
    """Quest page scores ``sum_d max(q_d M_d, q_d m_d)`` (float32; ``-inf`` on empty pages).

    ``q [B, Hkv, G, T, D]`` (query head ``kv * G + g``, row ``t``); bounds ``[B, Hkv, P, D]``.
    Returns ``[B, Hkv, G, T, P]``. Per channel exactly one of ``max(q, 0) M`` and ``min(q, 0) m`` is
    non-zero, so the two contractions equal the per-channel maximum.
    """
    q = q.astype(jnp.float32)
    hi = jnp.einsum("bkgtd,bkpd->bkgtp", jnp.maximum(q, 0.0), k_max)
    lo = jnp.einsum("bkgtd,bkpd->bkgtp", jnp.minimum(q, 0.0), k_min)
    return jnp.where(page_valid[:, None, None, None, :], hi + lo, -jnp.inf)


def pages_to_select(budget: int, page_size: int, min_pages: int = 3) -> int:
    """Pages attended per query: ``max(min_pages, budget // page_size)`` (official Quest)."""
    return max(min_pages, budget // page_size)


def select_pages(scores: jax.Array, page_valid: jax.Array, num_pages: int) -> jax.Array:
    """Boolean ``[..., P]``: the top ``num_pages`` valid pages by ``scores [B, Hkv, G, T, P]``
    (ties: lower page). Fewer valid pages: all of them."""
    pages = scores.shape[-1]
    take = min(num_pages, pages)
    _, top = jax.lax.top_k(scores, take)
    chosen = jnp.put_along_axis(jnp.zeros(scores.shape, bool), top, True, axis=-1, inplace=False)
    return chosen & page_valid[:, None, None, None, :]


def quest_mask(q: jax.Array, keys: jax.Array, lengths: jax.Array, *, budget: int, page_size: int = 16,
               min_pages: int = 3) -> jax.Array:
    """History mask ``[B, Hkv, G, T, S]`` of Quest for queries ``q [B, Hkv, G, T, D]`` over
    ``keys [B, Hkv, S, D]`` with ``lengths [B]`` valid positions."""
    seq = keys.shape[2]
    k_max, k_min, page_valid = page_bounds(keys, lengths, page_size)
    scores = page_scores(q, k_max, k_min, page_valid)
    chosen = select_pages(scores, page_valid, pages_to_select(budget, page_size, min_pages))
    per_position = jnp.repeat(chosen, page_size, axis=-1)[..., :seq]
    valid = jnp.arange(seq)[None, :] < lengths[:, None]
    return per_position & valid[:, None, None, None, :]


# ---------------------------------------------------------------------------- forward
def _quest_attention(config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, *, budget, page_size,
                     min_pages):
    """``jaxspec.models.attention.xla_attention`` with the history restricted to each (query head,
    row)'s Quest pages."""
    batch, steps, num_heads, dim = q.shape
    groups = config.queries_per_kv
    scale = 1.0 / np.sqrt(dim)
    qg = q.reshape(batch, steps, config.num_kv_heads, groups, dim).transpose(0, 2, 3, 1, 4)  # [B,Hkv,G,T,D]
    mask = quest_mask(qg, cache_k, lengths, budget=budget, page_size=page_size, min_pages=min_pages)
    scores_hist = grouped_key_scores(cache_k, qg) * scale
    scores_hist = jnp.where(mask, scores_hist, -jnp.inf)
    kn = k_new.transpose(0, 2, 1, 3)
    vn = v_new.transpose(0, 2, 1, 3)
    scores_new = jnp.einsum("bkgtd,bkud->bkgtu", qg, kn, preferred_element_type=jnp.float32) * scale
    scores_new = jnp.where(jnp.tril(jnp.ones((steps, steps), bool)), scores_new, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([scores_hist, scores_new], axis=-1), axis=-1)
    hist_len = cache_k.shape[2]
    out = jnp.einsum("bkgts,bksd->bkgtd", probs[..., :hist_len].astype(q.dtype), cache_v,
                     preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgtu,bkud->bkgtd", probs[..., hist_len:].astype(q.dtype), vn,
                           preferred_element_type=jnp.float32)
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(batch, steps, num_heads, dim)


def quest_verify_forward(params, tokens, cache: KVCache, *, config: ModelConfig, budget: int, page_size: int = 16,
                         dense_layers: int = 2, min_pages: int = 3) -> ForwardOutput:
    """The target forward of ``tokens [B, T]`` with Quest attention in layers ``>= dense_layers``.

    Same contract as ``llama.forward`` without options: writes the ``T`` tokens' K/V at
    ``cache.lengths ..`` and returns the logits ``[B, T, V]`` and the advanced cache. Traceable
    (call it inside ``jax.jit``). Built from the model's blocks (:mod:`jaxspec.models.layers`);
    only the attention of the Quest layers is replaced.
    """
    steps = tokens.shape[1]
    lengths = cache.lengths
    history = cache.read_lengths  # what the attention reads: 1 slot for a frozen (finished) row
    cos, sin = rope_tables(config, default_positions(lengths, steps))
    h = embed(params, tokens, config)
    keys, values = list(cache.keys), list(cache.values)

    def quest_attend(i):  # the Quest layers' attention over layer i's cache
        def attend(q, k_new, v_new):
            return _quest_attention(config, q, k_new, v_new, cache.keys[i], cache.values[i], lengths, budget=budget,
                                    page_size=page_size, min_pages=min_pages)
        return attend

    for i, layer in enumerate(params.layers):
        attend = quest_attend(i) if i >= dense_layers else None
        with jax.named_scope(f"layer{i}"):
            out = decoder_layer(layer, h, config, cos, sin, cache.keys[i], cache.values[i], lengths, attend=attend,
                                history_lengths=history)
            h, keys[i], values[i] = out.hidden, out.cache_k, out.cache_v
    logits = lm_head(params, h, config)
    return ForwardOutput(logits=logits, cache=KVCache(keys=tuple(keys), values=tuple(values), lengths=lengths + steps,
                                                      frozen=cache.frozen), probes=None)


@dataclasses.dataclass(frozen=True)
class QuestVerify(VerifyPolicyBase):
    """Quest verification settings (token ``budget`` per query head, pages of ``page_size``)."""

    budget: int = 1024
    page_size: int = 16
    dense_layers: int = 2
    min_pages: int = 3
    name: str = "quest"

    def __post_init__(self):
        if self.budget < 1 or self.page_size < 1 or self.dense_layers < 0 or self.min_pages < 1:
            raise ValueError(f"bad Quest settings {self}")

    @property
    def num_pages(self) -> int:
        return pages_to_select(self.budget, self.page_size, self.min_pages)

    def verify_indices(self, state, target_cache, committed, signals):
        raise TypeError(
            "Quest selects per layer, query head and query row; the engine's verify_indices is one set per "
            "sequence; the engine verifies through QuestVerify.verify_forward (speculative_generate or "
            "quest_speculative_generate with verify_policy=QuestVerify(...)).")

    def verify_forward(self, target_params, rows, target_cache, committed, signals, *, config, state):
        """The engine's verify-forward hook: :func:`quest_verify_forward` at ``committed - 1``."""
        return quest_verify_forward(target_params, rows, target_cache.with_lengths(committed - 1), config=config,
                                    budget=self.budget, page_size=self.page_size, dense_layers=self.dense_layers,
                                    min_pages=self.min_pages)


def quest_speculative_generate(target_params, target_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                               draft_policy, verify_policy: QuestVerify = QuestVerify(), draft_params=None,
                               draft_state=None, engine: EngineConfig = EngineConfig(), seed: int = 0,
                               capacity: Optional[int] = None, warmup: bool = False, **kwargs) -> SpeculativeResult:
    """``speculative_generate`` with Quest verification (``verify_policy``: a :class:`QuestVerify`, or
    any verify policy whose ``verify_forward`` does the verification). A budget covering the history
    reproduces ``speculative_generate`` with ``DenseVerify``. ``kwargs``: the engine's (``profile``,
    ``mesh``, ``controller``, ...)."""
    return speculative_generate(target_params, target_config, prompts, draft_policy=draft_policy,
                                draft_params=draft_params, draft_state=draft_state, verify_policy=verify_policy,
                                engine=engine, seed=seed, capacity=capacity, warmup=warmup, **kwargs)
