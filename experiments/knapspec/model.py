"""The model a ``knapspec`` or ``bench-plan`` run decodes with (:func:`load`: real weights, or random ones of a
preset's shape) and a case's prompts (:func:`build_prompts`: Austen texts framed as a task for real weights, random
tokens for random ones). Used by ``case``, ``experiment`` and ``bench_plan``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import numpy as np

from experiments.common import load_model_timed

INSTRUCTION = "Summarise the following text in a few paragraphs.\n\n"
#: prompts come from these books (row b uses book b mod 5); calibration from the sixth
PROMPT_BOOKS = ("Pride and Prejudice", "Emma", "Sense and Sensibility", "Mansfield Park", "Northanger Abbey")
CALIBRATION_BOOK = "Persuasion"


@dataclasses.dataclass
class Model:
    params: Any
    config: Any
    tokenizer: Any
    source: str
    real: bool


def load(args) -> Model:
    import jax

    if args.model.startswith("random:"):
        from jaxspec.config import preset
        from jaxspec.models.llama import init_params

        overrides = {"dtype": args.dtype, "attention_backend": args.attention_backend}
        if args.layers is not None:
            overrides["num_layers"] = int(args.layers)
        config = preset(args.model.split(":", 1)[1], **overrides)
        params = init_params(config, jax.random.PRNGKey(args.seed))
        return Model(params, config, None, args.model, real=False)
    if args.layers is not None:
        raise ValueError("--layers only applies to random:PRESET models")
    model = load_model_timed(args.model, args.dtype, args.attention_backend)
    return Model(model.params, model.config, model.tokenizer, args.model, real=True)


def _chat_frame(tokenizer) -> Tuple[List[int], List[int]]:
    """Token ids before and after the user text (chat template if the tokenizer has one)."""
    if getattr(tokenizer, "chat_template", None):
        marker = "@@TEXT@@"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                             tokenize=False)
        head, tail = text.split(marker)
        return list(tokenizer(head)["input_ids"]), list(tokenizer(tail)["input_ids"])
    return [], list(tokenizer("\n\nSummary:")["input_ids"])


_BOOK_IDS: Dict[str, List[int]] = {}


def book_ids(tokenizer, title: str, limit: int) -> List[int]:
    if title not in _BOOK_IDS or len(_BOOK_IDS[title]) < limit:
        from jaxspec.data.corpus import austen_books

        text = austen_books(progress=False)[title]
        # skip the title page; 6 characters a token is ample for English prose
        _BOOK_IDS[title] = list(tokenizer(text[2000: 2000 + 6 * limit + 1000])["input_ids"])
    ids = _BOOK_IDS[title]
    if len(ids) < limit:
        raise ValueError(f"{title}: only {len(ids)} tokens available, {limit} needed")
    return ids[:limit]


def build_prompts(model: Model, task: str, length: int, batch: int, seed: int) -> List[List[int]]:
    """``batch`` prompts of exactly ``length`` tokens."""
    if not model.real:
        rng = np.random.default_rng(seed + length)
        return [rng.integers(0, model.config.vocab_size, length).tolist() for _ in range(batch)]
    head, tail = _chat_frame(model.tokenizer)
    if task == "summarize":
        head = head + list(model.tokenizer(INSTRUCTION)["input_ids"])
    else:
        head = head + list(model.tokenizer("Continue this story for several pages.\n\n")["input_ids"])
    room = length - len(head) - len(tail)
    if room < 16:
        raise ValueError(f"prompt length {length} leaves {room} tokens for the text")
    return [head + book_ids(model.tokenizer, PROMPT_BOOKS[b % len(PROMPT_BOOKS)], room) + tail
            for b in range(batch)]
