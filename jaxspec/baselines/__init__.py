"""Baselines as policies of the speculative engine: same engine, same gamma, same models.

Sparse attention (docs/methods.md §3.6; the layer-skipping baselines of §4.4 live in ``clasp.py`` and
``static_skip.py``):

* :class:`StreamingVerify` -- StreamingLLM verification (sinks + window, budget ``k = s + w``).
* :class:`SnapKVVerify` -- SnapKV verification: static prompt selection after prefill
  (observation window 32, average pooling 7, one set per sequence) + every generated token.
* :class:`QuestVerify` / :func:`quest_verify_forward` / :func:`quest_speculative_generate` --
  Quest verification (pages of 16, per-channel min/max bounds, top pages per layer, query head
  and verified row; first 2 layers dense). Per-layer sets do not fit the one-set
  ``verify_indices``, so Quest overrides the verify policy's ``verify_forward``.
* :class:`MagicDecDraft` / :class:`MagicDecSelfDraft` -- MagicDec drafts reading a StreamingLLM
  view (sinks + window) of their KV; pair with ``DenseVerify`` (MagicDec) or a sparse verifier.
* :class:`PromptLookupDraft` -- prompt lookup (n-gram) drafting: no draft model; the tokens that
  followed the latest n-gram's earlier occurrence in the row.

Every index set is ``[B, K]`` int32, ``-1`` padded, never a position at or past a row's history
length, and equals the whole history when the budget covers it.

Model changes that would make these baselines more exact or leaner (the engine side is done:
Quest verifies through the verify-forward hook of :mod:`jaxspec.decoding.contract`):

1. MagicDec: per-row index sets in ``forward`` (``verify_indices [B, T, K]``) would make the
   separate draft's two-token first step exact in one forward (today: one shared set, or
   ``exact_first_step=True`` at one extra draft forward per round).
2. MagicDec memory: a StreamingLLM ring cache (``sinks + window + gamma + 2`` slots, write slot
   decoupled from the RoPE position) so the draft cache does not hold the whole history; the
   reads are already limited to the budget.
3. SnapKV: the verify-policy ``prefill`` hook receives no config, so ``SnapKVVerify`` carries the
   target config as a field; passing ``config=`` to the hook would remove that.
"""

from jaxspec.baselines.magicdec import MagicDecDraft, MagicDecSelfDraft
from jaxspec.baselines.prompt_lookup import PromptLookupDraft
from jaxspec.baselines.quest import (QuestVerify, page_bounds, page_scores, quest_mask, quest_speculative_generate,
                                     quest_verify_forward)
from jaxspec.baselines.snapkv import SnapKVVerify, snapkv_scores, snapkv_select
from jaxspec.baselines.streaming import StreamingVerify, streaming_indices

__all__ = ["MagicDecDraft", "MagicDecSelfDraft", "PromptLookupDraft", "QuestVerify", "SnapKVVerify", "StreamingVerify",
           "page_bounds",
           "page_scores", "quest_mask", "quest_speculative_generate", "quest_verify_forward", "snapkv_scores",
           "snapkv_select", "streaming_indices"]
