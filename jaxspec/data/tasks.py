"""Seeded synthetic long-context retrieval tasks: passkey, needle QA, key-value retrieval.

Each task is one prompt of a target length in tokens (``context_tokens``: 2k/4k/8k/16k)
for a given tokenizer, with one inserted *needle* at a relative ``depth`` (0.0 = the
start of the haystack, 1.0 = its end), a question at the end and a short answer:

* ``passkey``: a haystack of real text with "The pass key is 482913. Remember it.
  482913 is the pass key." inside; the prompt ends "What is the pass key? The pass
  key is" (after Mohtashami & Jaggi, 2023).
* ``needle_qa``: a haystack of real text with one invented fact sentence inside
  (e.g. "The first mayor of the village of Dravenholt was a baker called Ada
  Morlisk."); the prompt ends with a question on it ("Question: ...\\nAnswer:").
  Names are made-up words, so the answer cannot come from memory.
* ``kv_retrieval``: no text haystack: a JSON object of random UUID keys and values,
  one per line; the prompt asks for the value of one key (after Liu et al., "Lost in
  the Middle", 2023). The needle is that key's ``"key": "value"`` line.

A :class:`Task` records the prompt, the answer, the needle text, its character span
and its **token span** ``[start, end)`` within ``encode(prompt)`` (the smallest token
range that covers the needle: needed to find semantic retrieval heads), the target
and actual token counts, depth and seed. Token counts are of the raw prompt without
special tokens: a BOS token or a chat template adds to them, and shifts the span
(recompute it with :func:`needle_token_span` on the wrapped text).

Lengths: the prompt never exceeds ``context_tokens`` and falls short of it by at most
``LENGTH_TOLERANCE`` (3 %) or, for key-value retrieval, one JSON line, whichever is
more (text tasks are usually within 0.5 %).

Reproducibility: a task is a pure function of (kind, tokenizer, haystack texts,
context_tokens, depth, seed); :func:`regenerate` rebuilds one. Randomness comes from
``random.Random`` streams seeded through sha256, so results do not depend on the
Python hash seed or the platform.

Calibration vs evaluation: :func:`split_haystack` cuts the haystack into disjoint
parts (whole documents when there are many, else the head / the tail of each
document), :meth:`TaskSuite.build` draws each split's tasks from its own part with
split-specific seeds, and :func:`build_splits` builds both and asserts disjointness.

Tokenizer: any object with ``encode(text)`` (called with ``add_special_tokens=False``
when it accepts it) or ``__call__(text)`` returning token ids (a list, an array, a
``tokenizers.Encoding`` or a mapping with ``input_ids``), and ``decode(ids)``.

Command line (builds a suite with a Hugging Face tokenizer folder, from ``austen``,
``wikipedia`` or your own ``.txt``/``.jsonl``)::

    python -m jaxspec.data.tasks build --tokenizer path/to/tokenizer_folder --source austen \\
        --split evaluation --lengths 2048 4096 --out tasks.jsonl

This package imports no model code, so registry model names and ``.gguf`` files are not
resolved here: call ``main(argv, load_tokenizer=jaxspec.models.loading.load_tokenizer)`` from
a layer that may import both (the experiments), or pass the tokenizer folder that loading a
registry model caches beside its GGUF file (``<cache>/<GGUF stem>.jaxspec-tokenizer``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import numbers
import os
import pathlib
import random
import re
import sys
import time
import unicodedata
import uuid
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

__all__ = [
    "TASK_KINDS",
    "DEFAULT_CONTEXT_LENGTHS",
    "DEFAULT_DEPTHS",
    "LENGTH_TOLERANCE",
    "Task",
    "TaskSuite",
    "make_passkey",
    "make_needle_qa",
    "make_kv_retrieval",
    "make_task",
    "regenerate",
    "needle_token_span",
    "split_haystack",
    "assert_disjoint_texts",
    "build_splits",
    "score_answer",
    "normalize_answer",
    "save_tasks",
    "load_tasks",
    "main",
]

TASK_KINDS = ("passkey", "needle_qa", "kv_retrieval")
DEFAULT_CONTEXT_LENGTHS = (2048, 4096, 8192, 16384)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
LENGTH_TOLERANCE = 0.03
SPLITS = ("calibration", "evaluation", "all")
FORMAT_VERSION = 1

_PASSKEY_HEADER = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n\n"
)
_NEEDLE_QA_HEADER = (
    "Read the following text carefully. Somewhere in it is a statement that answers "
    "the question at the end.\n\n"
)
_KV_HEADER = (
    "Extract the value corresponding to the specified key in the JSON object below.\n\n"
    "JSON data:\n"
)
_MIN_DISJOINT_CHARS = 64  # paragraphs at least this long must not occur in both splits


# ---------------------------------------------------------------------------- tokenizer
class TextCodec:
    """Uniform ``encode(text) -> list[int]`` / ``decode(ids) -> str`` over many kinds."""

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, TextCodec):
            tokenizer = tokenizer.inner
        if not (callable(getattr(tokenizer, "encode", None)) or callable(tokenizer)) or not callable(
                getattr(tokenizer, "decode", None)):
            raise TypeError(
                f"tokenizer {type(tokenizer).__name__} needs encode(text) or __call__(text) "
                "returning token ids, and decode(ids)"
            )
        self.inner = tokenizer

    def encode(self, text: str) -> list[int]:
        tokenizer = self.inner
        function = tokenizer.encode if callable(getattr(tokenizer, "encode", None)) else tokenizer
        try:
            output = function(text, add_special_tokens=False)
        except TypeError:
            output = function(text)
        return _as_ids(output)

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(list(ids))

    def label(self) -> str:
        tokenizer = self.inner
        name = getattr(tokenizer, "name_or_path", "") or ""
        name = pathlib.Path(str(name)).name if name else ""
        size = None
        try:
            size = len(tokenizer)
        except TypeError:
            size = getattr(tokenizer, "vocab_size", None)
            if callable(getattr(tokenizer, "get_vocab_size", None)):
                size = tokenizer.get_vocab_size()
        parts = [type(tokenizer).__name__] + ([name] if name else []) + ([f"vocab={size}"] if size else [])
        return " ".join(parts)


def _as_ids(output: Any) -> list[int]:
    if hasattr(output, "ids") and not isinstance(output, Mapping):  # tokenizers.Encoding
        output = output.ids
    elif isinstance(output, Mapping) or hasattr(output, "keys"):
        output = output["input_ids"]
    if hasattr(output, "tolist"):
        output = output.tolist()
    output = list(output)
    if output and isinstance(output[0], (list, tuple)):
        if len(output) != 1:
            raise ValueError(f"tokenizer returned a batch of {len(output)} sequences for one text")
        output = list(output[0])
    return [int(token) for token in output]


def _common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    count = min(len(first), len(second))
    for index in range(count):
        if first[index] != second[index]:
            return index
    return count


def needle_token_span(
    tokenizer: Any, text: str, char_start: int, char_end: int, ids: Sequence[int] | None = None
) -> tuple[int, int]:
    """The smallest token range ``[start, end)`` of ``encode(text)`` covering ``text[char_start:char_end]``.

    Works for any tokenizer whose encoding of a prefix of ``text`` agrees with the
    encoding of ``text`` up to the token that straddles the cut (true of BPE and
    SentencePiece tokenizers). A token merged across a needle boundary is included, so
    the decoded span may carry a character or two beyond the needle (a key-value
    needle's closing quote merges with the following comma); tokens holding only
    surrounding text are not. Pass ``ids`` if ``encode(text)`` is already at hand.
    """
    tok = TextCodec(tokenizer)
    if not 0 <= char_start < char_end <= len(text):
        raise ValueError(f"bad character span [{char_start}, {char_end}) for a text of {len(text)} characters")
    ids = list(ids) if ids is not None else tok.encode(text)
    before = tok.encode(text[:char_start])
    start = _common_prefix(ids, before)
    through = tok.encode(text[:char_end])
    common = _common_prefix(ids, through)
    end = len(through) if common == len(through) else common + 1
    end = min(max(end, start + 1), len(ids))
    # Drop edge tokens that hold only text around the needle (e.g. a "\n\n" token that
    # the prefix encoding split differently).
    needle = " ".join(text[char_start:char_end].split())

    def covers(first: int, last: int) -> bool:
        return first < last and needle in " ".join(tok.decode(ids[first:last]).split())

    if covers(start, end):
        while covers(start + 1, end):
            start += 1
        while covers(start, end - 1):
            end -= 1
    return start, end


# ---------------------------------------------------------------------------- randomness
def _derive_seed(*labels: object) -> int:
    """A 63-bit seed from labels, stable across runs and platforms."""
    digest = hashlib.sha256(json.dumps([str(label) for label in labels]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _rng(seed: int, stream: str) -> random.Random:
    return random.Random(_derive_seed("jaxspec.tasks", seed, stream))


_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kl", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "th", "nd", "rk", "m"]
_FIRST_NAMES = [
    "Ada", "Albert", "Beatrice", "Cedric", "Clara", "Desmond", "Edith", "Felix", "Greta", "Harold",
    "Iris", "Jasper", "Lena", "Magnus", "Nora", "Oswin", "Petra", "Quentin", "Rosa", "Silas",
    "Tilda", "Ulric", "Vera", "Walter", "Yvonne", "Otto", "Hilda", "Rupert", "Maud", "Linus",
]


def _made_up_word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    count = rng.randint(*syllables)
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(count)) + rng.choice(_CODAS)
    return word.capitalize()


def _made_up_place(rng: random.Random) -> str:
    return _made_up_word(rng) + rng.choice(["", "", "holt", "ford", "wick", "mere", "by", "haven"])


# (fact, question, answer field); fields: place, word, person, number
_FACTS: tuple[tuple[str, str, str], ...] = (
    ("The first mayor of the village of {place} was a baker called {person}.",
     "Who was the first mayor of the village of {place}?", "person"),
    ("The rare orchid that grows only on Mount {place} is known to botanists as {word}.",
     "What do botanists call the rare orchid that grows only on Mount {place}?", "word"),
    ("The ship {word} was the first to sail from the port of {place} to the far north.",
     "What was the name of the first ship to sail from the port of {place} to the far north?", "word"),
    ("There are exactly {number} steps leading up to the old bell tower of {place}.",
     "How many steps lead up to the old bell tower of {place}?", "number"),
    ("The lighthouse on the island of {place} is kept by an old dog named {word}.",
     "What is the name of the dog that keeps the lighthouse on the island of {place}?", "word"),
    ("Every spring the people of {place} hold a festival in honour of a river called the {word}.",
     "In honour of which river do the people of {place} hold a festival every spring?", "word"),
    ("The secret recipe of the famous bakery in {place} was written down by {person}.",
     "Who wrote down the secret recipe of the famous bakery in {place}?", "person"),
    ("The tallest tree in the forest of {place} is an oak that the locals call {word}.",
     "What do the locals call the tallest tree in the forest of {place}?", "word"),
)


# ---------------------------------------------------------------------------- tasks
@dataclasses.dataclass
class Task:
    """One long-context retrieval task (see the module doc).

    Attributes:
      task_id: unique within a suite, e.g. ``"evaluation/passkey/4096/d0.5/s0"``.
      kind: one of :data:`TASK_KINDS`.
      prompt: the full prompt text.
      question: the question at the end of the prompt (``prompt.endswith(question)``).
      answer: the expected answer string (scored by :func:`score_answer`).
      needle: the inserted needle text (contains ``answer``).
      needle_char_span: ``[start, end)`` of ``needle`` in ``prompt`` (characters).
      needle_span: ``[start, end)`` token range of ``encode(prompt)`` covering the needle.
      context_tokens: the target length in tokens.
      prompt_tokens: the actual length of ``encode(prompt)`` (<= ``context_tokens``).
      depth: requested relative position of the needle in the haystack, in [0, 1].
      seed: the task's seed (with the other fields it reproduces the task).
      split: ``"calibration"``, ``"evaluation"`` or ``"all"``.
      source: a label of the haystack source (e.g. ``"austen"``).
      haystack_sha256: fingerprint (16 hex digits) of the haystack texts the task was built from.
      tokenizer: a description of the tokenizer the token counts refer to.
    """

    task_id: str
    kind: str
    prompt: str
    question: str
    answer: str
    needle: str
    needle_char_span: tuple[int, int]
    needle_span: tuple[int, int]
    context_tokens: int
    prompt_tokens: int
    depth: float
    seed: int
    split: str = "all"
    source: str = "custom"
    haystack_sha256: str = ""
    tokenizer: str = ""

    @property
    def needle_depth(self) -> float:
        """Where the needle actually starts, as a fraction of the prompt's tokens."""
        return self.needle_span[0] / max(self.prompt_tokens, 1)

    def to_dict(self) -> dict:
        record = dataclasses.asdict(self)
        record["needle_char_span"] = list(self.needle_char_span)
        record["needle_span"] = list(self.needle_span)
        record["format"] = FORMAT_VERSION
        return record

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "Task":
        record = dict(record)
        version = record.pop("format", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"task format {version} is not supported (this code reads {FORMAT_VERSION})")
        names = {field.name for field in dataclasses.fields(cls)}
        missing = sorted(name for name in names if name not in record and name not in
                         ("split", "source", "haystack_sha256", "tokenizer"))
        if missing:
            raise ValueError(f"task record lacks fields {missing}")
        unknown = sorted(set(record) - names)
        if unknown:
            raise ValueError(f"task record has unknown fields {unknown}")
        record["needle_char_span"] = tuple(record["needle_char_span"])
        record["needle_span"] = tuple(record["needle_span"])
        return cls(**record)


def _haystack_fingerprint(texts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def _as_texts(haystack_texts: str | Sequence[str] | None, kind: str) -> list[str]:
    if haystack_texts is None:
        raise ValueError(f"a {kind} task needs haystack_texts (a list of documents)")
    if isinstance(haystack_texts, str):
        haystack_texts = [haystack_texts]
    texts = [text.strip() for text in haystack_texts if isinstance(text, str) and text.strip()]
    if not texts:
        raise ValueError("haystack_texts holds no text")
    return texts


def _check_common(context_tokens: int, depth: float) -> None:
    if not isinstance(context_tokens, numbers.Integral) or isinstance(context_tokens, bool) or context_tokens <= 0:
        raise ValueError(f"context_tokens must be a positive int, got {context_tokens!r}")
    if not (isinstance(depth, numbers.Real) and 0.0 <= depth <= 1.0):
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")


def _haystack_window(texts: Sequence[str], rng: random.Random, min_chars: int) -> tuple[str, bool]:
    """A stretch of at least ``min_chars`` characters of the haystack (or all of it).

    Documents in a seeded order, the first from a seeded paragraph (or sentence)
    start, joined with blank lines; a larger ``min_chars`` extends the same stream.
    Returns the text and whether the whole haystack was used.
    """
    order = list(range(len(texts)))
    rng.shuffle(order)
    first = texts[order[0]]
    offset = 0
    if len(first) > 2 * min_chars:
        offset = rng.randrange(len(first) - min_chars)
        match = re.compile(r"\n\s*\n").search(first, offset) or re.compile(r"[.!?]\s+").search(first, offset)
        offset = match.end() if match and match.end() < len(first) else 0
    pieces = [first[offset:]]
    total = len(pieces[0])
    used = 1
    for index in order[1:]:
        if total >= min_chars:
            break
        pieces.append(texts[index])
        total += len(texts[index]) + 2
        used += 1
    exhausted = used == len(texts) and total < min_chars
    if exhausted and offset:
        pieces.append(first[:offset])
    return "\n\n".join(piece.strip() for piece in pieces if piece.strip()), exhausted


_WORD_END = re.compile(r"\S(?=\s|$)")
_SENTENCE_END = re.compile(r"[.!?][\"'\u2019\u201d)\]]*(?=\s)|\n\s*\n")


def _insert(haystack: str, needle: str, depth: float, boundaries: Sequence[int]) -> tuple[str, int]:
    """Insert ``needle`` at the sentence boundary nearest ``depth * len(haystack)``.

    At a paragraph break the needle starts the next paragraph; inside a paragraph it
    follows the sentence it is put after. Returns the body and the needle's offset.
    """
    length = len(haystack)
    target = depth * length
    candidates = [0, length] + [b for b in boundaries if 0 < b < length]
    position = min(candidates, key=lambda b: (abs(b - target), b))
    before, after = haystack[:position].rstrip(), haystack[position:].lstrip()
    if not before:
        return needle + " " + after, 0
    if not after:
        return before + " " + needle, len(before) + 1
    gap = haystack[len(before):length - len(after)]
    if "\n\n" in gap:
        return before + gap + needle + " " + after, len(before) + len(gap)
    return before + " " + needle + gap + after, len(before) + 1


def _fit_length(
    evaluate: Callable[[int], int], count: int, target: int, first_guess: int, slack: int
) -> int:
    """The largest index ``i`` in ``[0, count)`` with ``evaluate(i) <= target``, or one close to it.

    ``evaluate`` (prompt tokens when cutting at index ``i``) is non-decreasing. Stops
    early at any ``i`` with ``target - slack <= evaluate(i) <= target``. Returns -1 if
    even index 0 is too long; ``count - 1`` if everything fits (caller checks length).
    """
    known: dict[int, int] = {}

    def value(index: int) -> int:
        if index not in known:
            known[index] = evaluate(index)
        return known[index]

    aim = target - slack / 2
    low, high = -1, count  # value(low) <= target < value(high); -1 and count are sentinels
    guess = min(max(first_guess, 0), count - 1)
    steps = 0
    while high - low > 1:
        steps += 1
        tokens = value(guess)
        if tokens <= target:
            low = guess
            if tokens >= target - slack:
                return guess
        else:
            high = guess
        if low >= 0 and high < count and steps > 8:  # slow progress: bisect
            guess = (low + high) // 2
        elif low >= 0 and high < count:  # interpolate inside the bracket
            fraction = (aim - value(low)) / max(value(high) - value(low), 1)
            guess = low + round(fraction * (high - low))
        else:  # scale the last guess by the token ratio
            guess = round((guess + 1) * aim / max(tokens, 1)) - 1
        if not low < guess < high:
            guess = min(max(guess, low + 1), high - 1)
    return low


_Content = tuple[str, str, str, str]  # needle, question, trailer, answer


def _build_text_task(
    kind: str,
    tokenizer: Any,
    haystack_texts: str | Sequence[str] | None,
    context_tokens: int,
    depth: float,
    seed: int,
    header: str,
    draw_content: Callable[[random.Random], _Content],
) -> dict:
    """Shared builder for haystack tasks: fill to length, insert the needle, locate it.

    ``draw_content`` is called with the task's content stream until its answer does not
    occur in the haystack window (the answer must come from the needle only).
    """
    tok = TextCodec(tokenizer)
    texts = _as_texts(haystack_texts, kind)
    _check_common(context_tokens, depth)
    content_rng = _rng(seed, f"{kind}/content")
    needle, question, trailer, answer = draw_content(content_rng)
    fixed = len(tok.encode(header + needle + " " + trailer))
    if fixed >= context_tokens:
        raise ValueError(
            f"context_tokens={context_tokens} is too short for a {kind} task: the instruction, "
            f"needle and question alone take {fixed} tokens"
        )
    budget = context_tokens - fixed
    sample_text = texts[0][:20_000]
    chars_per_token = max(len(sample_text) / max(len(tok.encode(sample_text)), 1), 0.5)
    min_chars = int(budget * chars_per_token * 1.25) + 256
    slack = max(2, int(0.002 * context_tokens))

    while True:
        window, exhausted = _haystack_window(texts, _rng(seed, f"{kind}/haystack"), min_chars)
        for _ in range(1000):
            if answer.casefold() not in window.casefold():
                break
            needle, question, trailer, answer = draw_content(content_rng)
        else:
            raise RuntimeError(f"every drawn {kind} answer occurs in the haystack")
        cuts = [match.end() for match in _WORD_END.finditer(window)]
        boundaries = [match.end() for match in _SENTENCE_END.finditer(window)]

        def prompt_for(index: int) -> tuple[str, int]:
            end = cuts[index]
            body, offset = _insert(window[:end], needle, depth, [b for b in boundaries if b < end])
            return header + body + trailer, len(header) + offset

        def evaluate(index: int) -> int:
            return len(tok.encode(prompt_for(index)[0]))

        chosen = _fit_length(evaluate, len(cuts), context_tokens, _first_cut(cuts, budget * chars_per_token), slack)
        if chosen < 0:
            raise ValueError(
                f"context_tokens={context_tokens} is too short for a {kind} task: the instruction, "
                f"needle, question and one word of haystack exceed it"
            )
        if evaluate(chosen) >= context_tokens * (1 - LENGTH_TOLERANCE):
            break
        if chosen < len(cuts) - 1:
            raise RuntimeError(
                f"could not fit a {kind} prompt to {context_tokens} tokens within {LENGTH_TOLERANCE:.0%} "
                f"(best: {evaluate(chosen)} tokens); is the tokenizer's count non-decreasing in the text?"
            )
        if exhausted:
            total_chars = sum(len(text) for text in texts)
            raise ValueError(
                f"the haystack is too small for a {context_tokens}-token {kind} task: it has "
                f"{total_chars:,} characters (about {int(total_chars / chars_per_token):,} tokens), "
                f"the task needs about {budget:,} tokens of haystack; pass more text"
            )
        min_chars *= 2  # the window ran out before the target length: take more text

    prompt, char_start = prompt_for(chosen)
    ids = tok.encode(prompt)
    return _finish(
        tok, kind, prompt, ids, char_start, needle, question, answer, context_tokens, depth, seed,
        _haystack_fingerprint(texts),
    )


def _first_cut(cuts: Sequence[int], chars: float) -> int:
    """Index of the first cut at or after ``chars`` characters."""
    low, high = 0, len(cuts) - 1
    while low < high:
        middle = (low + high) // 2
        if cuts[middle] < chars:
            low = middle + 1
        else:
            high = middle
    return low


def _finish(
    tok: TextCodec, kind: str, prompt: str, ids: list[int], char_start: int, needle: str, question: str,
    answer: str, context_tokens: int, depth: float, seed: int, fingerprint: str,
) -> dict:
    char_end = char_start + len(needle)
    if prompt[char_start:char_end] != needle:
        raise AssertionError("internal error: needle offset is wrong")
    span = needle_token_span(tok, prompt, char_start, char_end, ids=ids)
    decoded = " ".join(tok.decode(ids[span[0]:span[1]]).split())
    if " ".join(needle.split()) not in decoded:
        raise RuntimeError(
            f"the tokens {span} decode to {decoded[:200]!r}, which does not contain the needle "
            f"{needle!r}: the tokenizer's encoding of a prefix is not a prefix of the full encoding"
        )
    return dict(
        kind=kind, prompt=prompt, question=question, answer=answer, needle=needle,
        needle_char_span=(char_start, char_end), needle_span=span, context_tokens=int(context_tokens),
        prompt_tokens=len(ids), depth=float(depth), seed=int(seed), haystack_sha256=fingerprint,
        tokenizer=tok.label(),
    )


def _to_task(fields: dict, task_id: str | None, split: str, source: str) -> Task:
    if task_id is None:
        task_id = f"{split}/{fields['kind']}/{fields['context_tokens']}/d{fields['depth']:g}/seed{fields['seed']}"
    return Task(task_id=task_id, split=split, source=source, **fields)


def _passkey_content(rng: random.Random, digits: int) -> tuple[str, str, str, str]:
    passkey = str(rng.randrange(10 ** (digits - 1), 10**digits))
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key."
    question = "What is the pass key? The pass key is"
    return needle, question, "\n\n" + question, passkey


def make_passkey(
    tokenizer: Any,
    haystack_texts: str | Sequence[str],
    context_tokens: int,
    depth: float,
    seed: int,
    *,
    digits: int = 6,
    task_id: str | None = None,
    split: str = "all",
    source: str = "custom",
) -> Task:
    """A passkey retrieval task (see the module doc); the answer is a ``digits``-digit number."""
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be in 1..18, got {digits}")
    fields = _build_text_task(
        "passkey", tokenizer, haystack_texts, context_tokens, depth, seed, _PASSKEY_HEADER,
        lambda rng: _passkey_content(rng, digits),
    )
    return _to_task(fields, task_id, split, source)


def _needle_qa_content(rng: random.Random) -> tuple[str, str, str, str]:
    fact, question, answer_field = rng.choice(_FACTS)
    place = _made_up_place(rng)
    word = _made_up_word(rng)
    while word.lower() in place.lower():
        word = _made_up_word(rng)
    values = dict(
        place=place, word=word, number=str(rng.randrange(100, 1000)),
        person=f"{rng.choice(_FIRST_NAMES)} {_made_up_word(rng)}",
    )
    needle = fact.format(**values)
    question = f"Question: {question.format(**values)}\nAnswer:"
    return needle, question, "\n\n" + question, values[answer_field]


def make_needle_qa(
    tokenizer: Any,
    haystack_texts: str | Sequence[str],
    context_tokens: int,
    depth: float,
    seed: int,
    *,
    task_id: str | None = None,
    split: str = "all",
    source: str = "custom",
) -> Task:
    """A needle question-answering task: an invented fact, a question on it at the end."""
    fields = _build_text_task(
        "needle_qa", tokenizer, haystack_texts, context_tokens, depth, seed, _NEEDLE_QA_HEADER, _needle_qa_content,
    )
    return _to_task(fields, task_id, split, source)


def make_kv_retrieval(
    tokenizer: Any,
    haystack_texts: str | Sequence[str] | None,
    context_tokens: int,
    depth: float,
    seed: int,
    *,
    task_id: str | None = None,
    split: str = "all",
    source: str = "uuid-json",
) -> Task:
    """A key-value retrieval task over a JSON object of random UUIDs.

    ``haystack_texts`` is not used (the JSON object is the haystack); it is accepted
    so that all task makers share one signature. The queried pair sits at index
    ``round(depth * (pairs - 1))``. The prompt falls short of ``context_tokens`` by at
    most ``LENGTH_TOLERANCE`` or one JSON line, whichever is more.
    """
    del haystack_texts
    tok = TextCodec(tokenizer)
    _check_common(context_tokens, depth)
    rng = _rng(seed, "kv_retrieval/pairs")
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()

    def grow(count: int) -> None:
        while len(pairs) < count:
            key, value = str(uuid.UUID(int=rng.getrandbits(128), version=4)), str(
                uuid.UUID(int=rng.getrandbits(128), version=4))
            if key in seen or value in seen:
                continue
            seen.update((key, value))
            pairs.append((key, value))

    def trailer_for(key: str) -> str:
        return f'\n\nKey: "{key}"\nCorresponding value:'

    def build(count: int) -> tuple[str, int, str, str, str]:
        grow(count)
        query = round(depth * (count - 1))
        lines = [f'"{key}": "{value}"' for key, value in pairs[:count]]
        key, value = pairs[query]
        body = "{\n" + ",\n".join("  " + line for line in lines) + "\n}"
        char_start = len(_KV_HEADER) + 2 + sum(len(line) + 4 for line in lines[:query]) + 2
        return _KV_HEADER + body + trailer_for(key), char_start, lines[query], key, value

    one_pair = len(tok.encode(build(1)[0]))
    per_pair = max((len(tok.encode(build(21)[0])) - one_pair) / 20, 1.0)
    if one_pair > context_tokens:
        raise ValueError(
            f"context_tokens={context_tokens} is too short for a kv_retrieval task: the instruction, "
            f"one key-value pair and the question take {one_pair} tokens"
        )
    max_pairs = int((context_tokens - one_pair) / per_pair * 1.5) + 8
    slack = max(2, int(0.002 * context_tokens))
    chosen = _fit_length(
        lambda index: len(tok.encode(build(index + 1)[0])), max_pairs, context_tokens,
        int((context_tokens - one_pair) / per_pair), slack,
    )
    count = chosen + 1
    if count < 1:
        raise ValueError(f"context_tokens={context_tokens} is too short for a kv_retrieval task")
    prompt, char_start, needle, key, value = build(count)
    ids = tok.encode(prompt)
    allowed = max(LENGTH_TOLERANCE * context_tokens, math.ceil(per_pair * 1.5))
    if len(ids) > context_tokens or len(ids) < context_tokens - allowed:
        raise RuntimeError(
            f"could not fit a kv_retrieval prompt to {context_tokens} tokens ({len(ids)} tokens with {count} pairs)"
        )
    question = trailer_for(key).strip()
    fields = _finish(
        tok, "kv_retrieval", prompt, ids, char_start, needle, question, value, context_tokens, depth, seed,
        "",
    )
    return _to_task(fields, task_id, split, source)


_MAKERS: dict[str, Callable[..., Task]] = {
    "passkey": make_passkey,
    "needle_qa": make_needle_qa,
    "kv_retrieval": make_kv_retrieval,
}


def make_task(
    kind: str, tokenizer: Any, haystack_texts: str | Sequence[str] | None, context_tokens: int, depth: float,
    seed: int, **options: Any,
) -> Task:
    """Dispatch to ``make_<kind>``."""
    if kind not in _MAKERS:
        raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(TASK_KINDS)}")
    return _MAKERS[kind](tokenizer, haystack_texts, context_tokens, depth, seed, **options)


def regenerate(
    task: Task, tokenizer: Any, haystack_texts: str | Sequence[str] | None, *, calibration_fraction: float = 0.25
) -> Task:
    """Rebuild ``task`` from its parameters.

    ``haystack_texts`` may be the texts the task was built from, or, for a task of a
    calibration/evaluation suite, the whole haystack (its split part is then taken
    with ``calibration_fraction``). Raises ``ValueError`` if neither matches the task's
    recorded haystack fingerprint.
    """
    texts = None
    if task.kind != "kv_retrieval":
        texts = _as_texts(haystack_texts, task.kind)
        fingerprint = _haystack_fingerprint(texts)
        if task.haystack_sha256 and fingerprint != task.haystack_sha256 and task.split in ("calibration", "evaluation"):
            texts = split_haystack(texts, calibration_fraction)[0 if task.split == "calibration" else 1]
            fingerprint = _haystack_fingerprint(texts)
        if task.haystack_sha256 and fingerprint != task.haystack_sha256:
            raise ValueError(
                f"task {task.task_id} was built from haystack {task.haystack_sha256}, "
                f"these texts are {fingerprint}"
            )
    options = {"source": task.source}
    if task.kind == "passkey":
        options["digits"] = len(task.answer)
    return make_task(
        task.kind, tokenizer, texts, task.context_tokens, task.depth, task.seed,
        task_id=task.task_id, split=task.split, **options,
    )


# ---------------------------------------------------------------------------- splits
def _paragraphs(text: str) -> Iterator[str]:
    for paragraph in re.split(r"\n\s*\n", text):
        normalized = " ".join(paragraph.split())
        if len(normalized) >= _MIN_DISJOINT_CHARS:
            yield normalized


def split_haystack(
    haystack_texts: str | Sequence[str], calibration_fraction: float = 0.25
) -> tuple[list[str], list[str]]:
    """Cut the haystack into disjoint ``(calibration_texts, evaluation_texts)``.

    With 8 or more documents whole documents are dealt out (a fixed shuffle, the first
    ``calibration_fraction`` of them to calibration); with fewer, each document is cut
    at the paragraph break nearest ``calibration_fraction`` of its length, the head
    going to calibration and the tail to evaluation. Paragraphs (64+ characters) that
    would occur in both parts are dropped from the calibration part, and the result is
    checked with :func:`assert_disjoint_texts`.
    """
    if not 0.0 < calibration_fraction < 1.0:
        raise ValueError(f"calibration_fraction must be in (0, 1), got {calibration_fraction}")
    texts = _as_texts(haystack_texts, "split")
    if len(texts) >= 8:
        order = list(range(len(texts)))
        random.Random(_derive_seed("jaxspec.tasks", "split_haystack")).shuffle(order)
        count = min(max(1, round(len(texts) * calibration_fraction)), len(texts) - 1)
        calibration = [texts[index] for index in sorted(order[:count])]
        evaluation = [texts[index] for index in sorted(order[count:])]
    else:
        calibration, evaluation = [], []
        for text in texts:
            target = calibration_fraction * len(text)
            breaks = [match.start() for match in re.finditer(r"\n\s*\n", text)]
            if not breaks:
                breaks = [match.end() for match in re.finditer(r"[.!?]\s+", text)]
            cut = min(breaks, key=lambda position: abs(position - target)) if breaks else round(target)
            head, tail = text[:cut].strip(), text[cut:].strip()
            if head:
                calibration.append(head)
            if tail:
                evaluation.append(tail)
    shared = set(paragraph for text in evaluation for paragraph in _paragraphs(text))
    cleaned = []
    for text in calibration:
        pieces = re.split(r"(\n\s*\n)", text)
        kept = [
            piece for index, piece in enumerate(pieces)
            if index % 2 == 1 or " ".join(piece.split()) not in shared
        ]
        cleaned_text = "".join(kept).strip()
        if cleaned_text:
            cleaned.append(cleaned_text)
    if not cleaned or not evaluation:
        raise ValueError("the haystack is too small to split into calibration and evaluation parts")
    assert_disjoint_texts(cleaned, evaluation)
    return cleaned, evaluation


def assert_disjoint_texts(first: Sequence[str], second: Sequence[str]) -> None:
    """Raise ``ValueError`` if a paragraph of 64+ characters occurs in both text lists."""
    seen = set(paragraph for text in first for paragraph in _paragraphs(text))
    for text in second:
        for paragraph in _paragraphs(text):
            if paragraph in seen:
                raise ValueError(f"calibration and evaluation texts share the paragraph {paragraph[:120]!r}...")


# ---------------------------------------------------------------------------- suites
@dataclasses.dataclass
class TaskSuite:
    """A list of tasks with save/load, filtering and scoring."""

    tasks: list[Task]

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __getitem__(self, index: int) -> Task:
        return self.tasks[index]

    @classmethod
    def build(
        cls,
        tokenizer: Any,
        haystack_texts: str | Sequence[str],
        *,
        kinds: Sequence[str] = TASK_KINDS,
        context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
        depths: Sequence[float] = DEFAULT_DEPTHS,
        samples: int = 1,
        seed: int = 0,
        split: str = "evaluation",
        calibration_fraction: float = 0.25,
        source: str = "custom",
        progress: bool = False,
    ) -> "TaskSuite":
        """A fixed seeded sample: ``samples`` tasks per (kind, length, depth).

        ``split="calibration"``/``"evaluation"`` draws the haystack from that part of
        :func:`split_haystack` and derives the task seeds from the split's name, so the
        two splits never share text or seeds; ``split="all"`` uses the whole haystack.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        unknown = [kind for kind in kinds if kind not in _MAKERS]
        if unknown:
            raise ValueError(f"unknown task kinds {unknown}; known: {', '.join(TASK_KINDS)}")
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        texts = _as_texts(haystack_texts, "suite") if any(kind != "kv_retrieval" for kind in kinds) else None
        if texts is not None and split != "all":
            texts = split_haystack(texts, calibration_fraction)[0 if split == "calibration" else 1]
        tasks = []
        started = time.monotonic()
        for kind in kinds:
            for context_tokens in context_lengths:
                for depth in depths:
                    for sample in range(samples):
                        task_seed = _derive_seed(seed, split, kind, context_tokens, float(depth), sample)
                        task_id = f"{split}/{kind}/{context_tokens}/d{float(depth):g}/s{sample}"
                        tasks.append(make_task(
                            kind, tokenizer, texts, context_tokens, float(depth), task_seed,
                            task_id=task_id, split=split,
                            **({"source": source} if kind != "kv_retrieval" else {}),
                        ))
                if progress:
                    print(f"[jaxspec.tasks] {split} {kind} {context_tokens}: {len(tasks)} tasks, "
                          f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        return cls(tasks)

    def filter(self, *, kind: str | None = None, context_tokens: int | None = None,
               depth: float | None = None) -> "TaskSuite":
        return TaskSuite([
            task for task in self.tasks
            if (kind is None or task.kind == kind)
            and (context_tokens is None or task.context_tokens == context_tokens)
            and (depth is None or task.depth == depth)
        ])

    def save(self, path: str | os.PathLike) -> None:
        save_tasks(self.tasks, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TaskSuite":
        return cls(load_tasks(path))

    def check(self, tokenizer: Any) -> None:
        """Re-tokenize every prompt; raise if a token count or needle span is off."""
        tok = TextCodec(tokenizer)
        for task in self.tasks:
            ids = tok.encode(task.prompt)
            if len(ids) != task.prompt_tokens:
                raise ValueError(
                    f"{task.task_id}: the prompt has {len(ids)} tokens with this tokenizer, the task "
                    f"records {task.prompt_tokens} (built with {task.tokenizer!r})"
                )
            span = needle_token_span(tok, task.prompt, *task.needle_char_span, ids=ids)
            if tuple(span) != tuple(task.needle_span):
                raise ValueError(f"{task.task_id}: needle span is {span}, the task records {task.needle_span}")

    def score(self, generations: Mapping[str, str] | Sequence[str]) -> dict:
        """Accuracy of ``generations`` (by task id, or a list in task order).

        Returns ``{"accuracy": float, "count": int, "correct": {task_id: bool},
        "by_cell": {"kind/context_tokens/depth": accuracy}}``.
        """
        if isinstance(generations, Mapping):
            missing = [task.task_id for task in self.tasks if task.task_id not in generations]
            if missing:
                raise ValueError(f"no generation for {len(missing)} tasks, e.g. {missing[:3]}")
            texts = [generations[task.task_id] for task in self.tasks]
        else:
            texts = list(generations)
            if len(texts) != len(self.tasks):
                raise ValueError(f"{len(texts)} generations for {len(self.tasks)} tasks")
        correct = {task.task_id: score_answer(task, text) for task, text in zip(self.tasks, texts)}
        cells: dict[str, list[bool]] = {}
        for task in self.tasks:
            cells.setdefault(f"{task.kind}/{task.context_tokens}/{task.depth:g}", []).append(correct[task.task_id])
        return {
            "accuracy": sum(correct.values()) / max(len(correct), 1),
            "count": len(correct),
            "correct": correct,
            "by_cell": {cell: sum(values) / len(values) for cell, values in cells.items()},
        }


def build_splits(
    tokenizer: Any,
    haystack_texts: str | Sequence[str],
    *,
    kinds: Sequence[str] = TASK_KINDS,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    calibration_samples: int = 1,
    evaluation_samples: int = 1,
    seed: int = 0,
    calibration_fraction: float = 0.25,
    source: str = "custom",
    progress: bool = False,
) -> tuple[TaskSuite, TaskSuite]:
    """``(calibration, evaluation)`` suites over disjoint haystack parts and seeds (asserted)."""
    common = dict(kinds=kinds, context_lengths=context_lengths, depths=depths, seed=seed,
                  calibration_fraction=calibration_fraction, source=source, progress=progress)
    calibration = TaskSuite.build(tokenizer, haystack_texts, samples=calibration_samples, split="calibration",
                                  **common)
    evaluation = TaskSuite.build(tokenizer, haystack_texts, samples=evaluation_samples, split="evaluation",
                                 **common)
    _assert_disjoint_suites(calibration, evaluation, haystack_texts, kinds, calibration_fraction)
    return calibration, evaluation


def _assert_disjoint_suites(
    calibration: TaskSuite, evaluation: TaskSuite, haystack_texts: Any, kinds: Sequence[str], fraction: float,
) -> None:
    seeds = {task.seed for task in calibration} & {task.seed for task in evaluation}
    if seeds:
        raise AssertionError(f"calibration and evaluation share seeds {sorted(seeds)[:5]}")
    prompts = {task.prompt for task in calibration} & {task.prompt for task in evaluation}
    if prompts:
        raise AssertionError("calibration and evaluation share a prompt")
    if any(kind != "kv_retrieval" for kind in kinds):
        calibration_texts, evaluation_texts = split_haystack(haystack_texts, fraction)
        assert_disjoint_texts(calibration_texts, evaluation_texts)
        fingerprints = ({task.haystack_sha256 for task in calibration if task.haystack_sha256}
                        & {task.haystack_sha256 for task in evaluation if task.haystack_sha256})
        if fingerprints:
            raise AssertionError("calibration and evaluation tasks were built from the same haystack")


# ---------------------------------------------------------------------------- JSONL, scoring
def save_tasks(tasks: Iterable[Task], path: str | os.PathLike) -> None:
    """Write tasks as JSONL (one task object per line, UTF-8)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as stream:
        for task in tasks:
            stream.write(json.dumps(task.to_dict(), ensure_ascii=False) + "\n")


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Read tasks written by :func:`save_tasks`."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {str(path)!r} does not exist")
    tasks = []
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                tasks.append(Task.from_dict(json.loads(line)))
            except (json.JSONDecodeError, ValueError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a task record ({error})") from error
    return tasks


def normalize_answer(text: str) -> str:
    """NFKC, case-folded, every run of non-alphanumeric characters made one space, stripped."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[^\w]|_", " ", text).split())


def score_answer(task: Task | str, generated_text: str) -> bool:
    """True if the normalised answer occurs in the normalised generation as whole words.

    ``task`` may be a :class:`Task` or the answer string itself. "482913" matches
    "The pass key is 482913." but not "4829130"; case and punctuation are ignored.
    """
    answer = normalize_answer(task.answer if isinstance(task, Task) else task)
    if not answer:
        raise ValueError("the answer is empty after normalisation")
    return f" {answer} " in f" {normalize_answer(generated_text)} "


# ---------------------------------------------------------------------------- command line
def load_folder_tokenizer(spec: str) -> Any:
    """A Hugging Face tokenizer folder (``AutoTokenizer``), the command line's default loader."""
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    raise ValueError(
        f"--tokenizer {spec!r}: not a tokenizer folder. jaxspec.data imports no model code, so registry "
        "names and .gguf files are read by jaxspec.models.loading.load_tokenizer: pass "
        "main(argv, load_tokenizer=jaxspec.models.loading.load_tokenizer), or the folder "
        "'<cache>/<GGUF stem>.jaxspec-tokenizer' that loading the model once leaves beside its GGUF file")


def main(argv: Sequence[str] | None = None, load_tokenizer: Callable[[str], Any] = load_folder_tokenizer) -> int:
    """``build``: a seeded task suite as JSONL; ``load_tokenizer`` turns ``--tokenizer`` into a tokenizer."""
    parser = argparse.ArgumentParser(prog="python -m jaxspec.data.tasks",
                                     description="Build seeded long-context retrieval tasks as JSONL.")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build a task suite")
    build.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder (see the module docstring)")
    build.add_argument("--source", default="austen", help="austen, wikipedia, or a .txt/.jsonl file or folder")
    build.add_argument("--split", default="evaluation", choices=SPLITS)
    build.add_argument("--kinds", nargs="+", default=list(TASK_KINDS), choices=TASK_KINDS)
    build.add_argument("--lengths", nargs="+", type=int, default=list(DEFAULT_CONTEXT_LENGTHS))
    build.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS))
    build.add_argument("--samples", type=int, default=1)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--calibration-fraction", type=float, default=0.25)
    build.add_argument("--out", required=True)
    arguments = parser.parse_args(argv)

    from jaxspec.data.corpus import load_haystack

    tokenizer = load_tokenizer(arguments.tokenizer)
    texts = load_haystack(arguments.source)
    source = arguments.source if arguments.source in ("austen", "wikipedia") else pathlib.Path(arguments.source).name
    started = time.monotonic()
    suite = TaskSuite.build(
        tokenizer, texts, kinds=arguments.kinds, context_lengths=arguments.lengths, depths=arguments.depths,
        samples=arguments.samples, seed=arguments.seed, split=arguments.split,
        calibration_fraction=arguments.calibration_fraction, source=source, progress=True,
    )
    suite.save(arguments.out)
    print(f"{len(suite)} tasks written to {arguments.out} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
