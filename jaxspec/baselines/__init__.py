"""Baselines as policies of the speculative engine: same engine, same gamma, same models.

Sparse attention (SPEC 3.6; the layer-skipping baselines of SPEC 4.4 live in ``clasp.py`` and
``static_skip.py``):

* :class:`StreamingVerify` -- StreamingLLM verification (sinks + window, budget ``k = s + w``).
* :class:`SnapKVVerify` -- SnapKV verification: static prompt selection after prefill
  (observation window 32, average pooling 7, one set per sequence) + every generated token.
* :class:`QuestVerify` / :func:`quest_verify_forward` / :func:`quest_speculative_generate` --
  Quest verification (pages of 16, per-channel min/max bounds, top pages per layer, query head
  and verified row; first 2 layers dense). Per-layer sets do not fit the engine's one-set
  ``verify_indices``, so Quest runs its own verification forward inside the engine's rounds.
* :class:`MagicDecDraft` / :class:`MagicDecSelfDraft` -- MagicDec drafts reading a StreamingLLM
  view (sinks + window) of their KV; pair with ``DenseVerify`` (MagicDec) or a sparse verifier.

Every index set is ``[B, K]`` int32, ``-1`` padded, never a position at or past a row's history
length, and equals the whole history when the budget covers it.

Engine / model changes these baselines would need to be exact *and* run in the stock engine
(none made here; the engine files belong to another change):

1. Quest: a verify-forward hook in ``speculative.verify_phase`` -- if the verify policy defines
   ``verify_forward(target_params, rows, cache, committed, signals, *, config, state)``, call it
   instead of ``forward(..., verify_indices=...)`` (``QuestVerify.verify_forward`` has that
   signature). Then ``quest_speculative_generate`` (which re-uses the engine's private
   ``draft_phase`` / ``commit_phase`` / ``LoopState`` / ``init_draft_counts`` and so must track
   their signatures) can go, and Quest gets mesh, profile and the verify hooks for free.
   ``verify_indices [L, B, K]`` (per layer) would not be enough: Quest's set is per query head
   and per verified row.
2. MagicDec: per-row index sets in ``forward`` (``verify_indices [B, T, K]``) would make the
   separate draft's two-token first step exact in one forward (today: one shared set, or
   ``exact_first_step=True`` at one extra draft forward per round).
3. MagicDec memory: a StreamingLLM ring cache (``sinks + window + gamma + 2`` slots, write slot
   decoupled from the RoPE position) so the draft cache does not hold the whole history; the
   reads are already limited to the budget.
4. SnapKV: the verify-policy ``prefill`` hook receives no config, so ``SnapKVVerify`` carries the
   target config as a field; passing ``config=`` to the hook would remove that.
"""

from jaxspec.baselines.magicdec import MagicDecDraft, MagicDecSelfDraft
from jaxspec.baselines.quest import (QuestVerify, page_bounds, page_scores, quest_mask, quest_speculative_generate,
                                     quest_verify_forward)
from jaxspec.baselines.snapkv import SnapKVVerify, snapkv_scores, snapkv_select
from jaxspec.baselines.streaming import StreamingVerify, streaming_indices

__all__ = ["MagicDecDraft", "MagicDecSelfDraft", "QuestVerify", "SnapKVVerify", "StreamingVerify", "page_bounds",
           "page_scores", "quest_mask", "quest_speculative_generate", "quest_verify_forward", "snapkv_scores",
           "snapkv_select", "streaming_indices"]
