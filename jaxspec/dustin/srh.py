"""Semantic retrieval heads (SRHs) from needle-in-a-haystack runs (docs/methods.md §3.4, the CompressKV recipe).

For each needle test the model decodes greedily from the prompt; at every decode step that
**emits an answer token** (``count="answer"``, default) -- or any token of the needle span
(``count="needle"``) -- each (layer, query head) adds its attention mass on the needle's token
span (the step's query row: the forward that produced the emitted token). Only tests whose
answer recall (the fraction of the answer's tokens that occur in the output) exceeds
``recall_threshold`` (0.5) count. Heads are then ranked within each layer and the top
``per_layer`` (4) kept. Works for any model of the family (target or draft).

Cost: a prefill without probes, then ``max_new_tokens`` one-token forwards probing every head
(``[B, L*H, 1, S]`` attention probabilities per step, reduced on device to the needle mass).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import pad_prompts, prefill
from jaxspec.dustin.arr import all_heads
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward

COUNT_MODES = ("answer", "needle")


@dataclasses.dataclass(frozen=True)
class NeedleCase:
    """One needle test: prompt token ids, the needle's token span ``[start, end)`` in them, and
    the answer's token ids (as they occur in the needle)."""

    tokens: Tuple[int, ...]
    needle_span: Tuple[int, int]
    answer_ids: Tuple[int, ...]
    case_id: str = ""

    def __post_init__(self):
        start, end = self.needle_span
        if not 0 <= start < end <= len(self.tokens):
            raise ValueError(f"needle span {self.needle_span} outside a prompt of {len(self.tokens)} tokens "
                             f"({self.case_id or 'case'})")
        if not self.answer_ids:
            raise ValueError(f"{self.case_id or 'case'}: empty answer")
        if len(self.tokens) < 2:
            raise ValueError(f"{self.case_id or 'case'}: a prompt needs at least 2 tokens")


def _ranked(row: np.ndarray, candidates: np.ndarray) -> Tuple[int, ...]:
    """``candidates`` (head ids) by descending ``row[head]``, ties to the lower head."""
    order = np.lexsort((candidates, -row[candidates]))
    return tuple(int(h) for h in candidates[order])


def check_kv_groups(kv_groups: int, queries_per_kv: int, num_heads: int, per_layer: int) -> int:
    """Validate a GQA-aware SRH request; returns ``kv_groups``."""
    if queries_per_kv < 1 or num_heads % queries_per_kv:
        raise ValueError(f"queries_per_kv={queries_per_kv} does not divide the {num_heads} heads")
    total = num_heads // queries_per_kv
    if not 1 <= kv_groups <= total:
        raise ValueError(f"kv_groups={kv_groups}: valid 1..{total} (the model's KV heads)")
    if per_layer > kv_groups * queries_per_kv:
        raise ValueError(f"{per_layer} SRHs per layer do not fit in kv_groups={kv_groups} KV group(s) of "
                         f"{queries_per_kv} query heads; allow at least {-(-per_layer // queries_per_kv)} groups "
                         "or keep fewer heads per layer")
    return kv_groups


def grouped_top_heads(row: np.ndarray, per_layer: int, kv_groups: int, queries_per_kv: int) -> Tuple[int, ...]:
    """The ``per_layer`` heads of one layer's needle mass ``row [H]`` from at most ``kv_groups`` KV groups
    with the largest summed mass: every choice of groups is tried (``C(Hkv, kv_groups)``: at most 70 for
    8 KV heads), its best heads taken, and the best total wins (ties: the lexicographically first groups).
    Returned in descending mass order, like the unconstrained choice."""
    total_groups = row.size // queries_per_kv
    best, best_mass = None, -np.inf
    for chosen in itertools.combinations(range(total_groups), kv_groups):
        candidates = np.concatenate([np.arange(g * queries_per_kv, (g + 1) * queries_per_kv) for g in chosen])
        heads = _ranked(row, candidates)[:per_layer]
        mass = float(row[list(heads)].sum())
        if mass > best_mass + 1e-12:
            best, best_mass = heads, mass
    return _ranked(row, np.asarray(best))


def cases_from_tasks(tasks, tokenizer, *, prefix_ids: Sequence[int] = ()) -> List[NeedleCase]:
    """Needle cases from :class:`jaxspec.data.Task` objects (``prefix_ids``, e.g. a BOS token, are
    prepended and shift the spans). The answer ids are the prompt tokens covering the answer
    inside the needle."""
    from jaxspec.data.tasks import TextCodec, needle_token_span

    tok = TextCodec(tokenizer)
    cases = []
    for task in tasks:
        ids = tok.encode(task.prompt)
        if len(ids) != task.prompt_tokens:
            raise ValueError(f"{task.task_id}: the prompt has {len(ids)} tokens with this tokenizer, the task "
                             f"records {task.prompt_tokens} (built with {task.tokenizer!r})")
        where = task.prompt.find(task.answer, task.needle_char_span[0], task.needle_char_span[1])
        if where < 0:
            raise ValueError(f"{task.task_id}: the answer {task.answer!r} does not occur in the needle")
        a0, a1 = needle_token_span(tok, task.prompt, where, where + len(task.answer), ids=ids)
        shift = len(prefix_ids)
        cases.append(NeedleCase(tokens=tuple(prefix_ids) + tuple(ids),
                                needle_span=(task.needle_span[0] + shift, task.needle_span[1] + shift),
                                answer_ids=tuple(ids[a0:a1]), case_id=task.task_id))
    return cases


@dataclasses.dataclass
class SRHResult:
    """Per-head needle attention mass and which tests counted."""

    scores: np.ndarray  # [L, H] summed needle mass over counted steps of kept tests
    recall: np.ndarray  # [num_cases] answer recall of each test
    kept: np.ndarray  # [num_cases] bool: recall > threshold
    counted_steps: np.ndarray  # [num_cases] decode steps that added mass
    generated: List[List[int]]  # greedy outputs
    case_ids: List[str]

    def top_heads(self, per_layer: int = 4, *, kv_groups: Optional[int] = None,
                  queries_per_kv: int = 1) -> Tuple[Tuple[int, ...], ...]:
        """Per layer, the ``per_layer`` heads with the most needle mass (ties: lower head).

        ``kv_groups`` (GQA-aware choice, docs/methods.md §3.4): the heads of a layer come from at
        most that many KV groups (``head // queries_per_kv``), the set with the most summed needle
        mass under that constraint. Scoring reads each KV group's keys once per layer
        (:func:`jaxspec.dustin.signals.srh_scores`), so fewer groups read fewer keys every round.
        """
        if not self.kept.any():
            raise ValueError(f"no needle test reached the recall threshold (recalls {np.round(self.recall, 2)}): "
                             "the model does not retrieve these needles; use shorter/easier tests or a lower "
                             "recall_threshold")
        num_heads = self.scores.shape[1]
        heads = min(per_layer, num_heads)
        if kv_groups is None:
            return tuple(_ranked(row, np.arange(num_heads))[:heads] for row in self.scores)
        groups = check_kv_groups(kv_groups, queries_per_kv, num_heads, heads)
        return tuple(grouped_top_heads(row, heads, groups, queries_per_kv) for row in self.scores)

    def to_dict(self) -> dict:
        return {"scores": np.round(self.scores, 6).tolist(), "recall": self.recall.tolist(),
                "kept": self.kept.tolist(), "counted_steps": self.counted_steps.tolist(), "case_ids": self.case_ids}


def _needle_decode_fn(params, first, cache, span_mask, skip_mask, *, config, steps):
    heads = all_heads(config)

    def body(carry, _):
        cache, token = carry
        out = forward(params, token[:, None], cache, config=config, probe_heads=heads, skip_mask=skip_mask)
        probs = out.probes.history_probs[:, :, 0, :]  # [B, L*H, S]
        mass = jnp.sum(jnp.where(span_mask[:, None, :], probs, 0.0), axis=-1)
        nxt = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        return (out.cache, nxt), (nxt, mass)

    _, (tokens, masses) = jax.lax.scan(body, (cache, first), None, length=steps)
    return tokens.T, masses.transpose(1, 0, 2)  # [B, N], [B, N, L*H]


_needle_decode = jax.jit(_needle_decode_fn, static_argnames=("config", "steps"))


def answer_recall(answer_ids: Sequence[int], generated: Sequence[int]) -> float:
    """Fraction of the answer's tokens (with multiplicity) found in the generated tokens."""
    remaining = list(generated)
    found = 0
    for token in answer_ids:
        if token in remaining:
            remaining.remove(token)
            found += 1
    return found / len(answer_ids)


def identify_srh(params, config: ModelConfig, cases: Sequence[NeedleCase], *, max_new_tokens: Optional[int] = None,
                 recall_threshold: float = 0.5, count: str = "answer", batch_size: int = 4,
                 skip_mask=None) -> SRHResult:
    """Run the needle tests and score every (layer, head); see the module doc.

    ``max_new_tokens``: decode steps per test (default: the longest answer + 8). ``skip_mask``
    (``[L, 2]``): score a self-draft -- the prompt is prefilled by the full model (a self-draft
    reads the target's cache) and the decode steps skip the masked sub-layers (a skipped
    attention layer scores zero).
    """
    if count not in COUNT_MODES:
        raise ValueError(f"count={count!r}; valid: {COUNT_MODES}")
    if not cases:
        raise ValueError("no needle cases")
    steps = max_new_tokens or max(len(c.answer_ids) for c in cases) + 8
    num_layers, num_heads = config.num_layers, config.num_heads
    scores = np.zeros((num_layers, num_heads), np.float64)
    recalls, kept, counted, generated = [], [], [], []
    for start in range(0, len(cases), batch_size):
        chunk = list(cases[start:start + batch_size])
        tokens, lengths = pad_prompts([c.tokens for c in chunk])
        capacity = int(lengths.max()) + steps + 1
        cache = init_cache(config, len(chunk), capacity)
        cache, _ = prefill(params, config, tokens, lengths - 1, cache)  # the last prompt token is decode step 0
        first = jnp.asarray(tokens[np.arange(len(chunk)), lengths - 1], jnp.int32)
        span = np.zeros((len(chunk), capacity), bool)
        for row, case in enumerate(chunk):
            span[row, case.needle_span[0]:case.needle_span[1]] = True
        mask = None if skip_mask is None else jnp.asarray(skip_mask, bool)
        out, masses = _needle_decode(params, first, cache, jnp.asarray(span), mask, config=config, steps=steps)
        out, masses = np.asarray(out), np.asarray(masses, np.float64)
        for row, case in enumerate(chunk):
            emitted = out[row].tolist()
            recall = answer_recall(case.answer_ids, emitted)
            target = set(case.answer_ids) if count == "answer" else set(case.tokens[slice(*case.needle_span)])
            steps_hit = [i for i, token in enumerate(emitted) if token in target]
            recalls.append(recall)
            generated.append(emitted)
            good = recall > recall_threshold
            kept.append(good)
            counted.append(len(steps_hit) if good else 0)
            if good and steps_hit:
                scores += masses[row, steps_hit].sum(axis=0).reshape(num_layers, num_heads)
    return SRHResult(scores=scores, recall=np.asarray(recalls), kept=np.asarray(kept, bool),
                     counted_steps=np.asarray(counted), generated=generated, case_ids=[c.case_id for c in cases])
