"""Evaluation text and synthetic long-context tasks.

* :mod:`jaxspec.data.corpus`: the Austen novels and Wikipedia lead summaries, fetched
  from package registries at set-up time and cached; the user's own ``.txt``/``.jsonl``.
* :mod:`jaxspec.data.tasks`: seeded passkey, needle-QA and key-value retrieval tasks
  at a target token length, with needle token spans, calibration/evaluation splits,
  JSONL save/load and answer scoring.

Nothing here imports JAX or model code; downloads go through :mod:`jaxspec.assets`, and the
Austen texts are read from R's data files with the PyPI package ``rdata`` (imported only then).
"""

from jaxspec.data.corpus import austen_books, load_haystack, load_text_source, wikipedia_summaries
from jaxspec.data.tasks import (
    Task,
    TaskSuite,
    build_splits,
    make_kv_retrieval,
    make_needle_qa,
    make_passkey,
    score_answer,
    split_haystack,
)

__all__ = [
    "austen_books",
    "wikipedia_summaries",
    "load_text_source",
    "load_haystack",
    "Task",
    "TaskSuite",
    "build_splits",
    "make_passkey",
    "make_needle_qa",
    "make_kv_retrieval",
    "score_answer",
    "split_haystack",
]
