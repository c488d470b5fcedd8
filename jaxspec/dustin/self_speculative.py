"""Self-speculative sparse verification under KnapSpec's changing plans (docs/methods.md §5.5).

The draft is the target with sub-layers skipped (:class:`~jaxspec.dustin.policy.DustinSelfDraft`); its
executed attention at the draft SRH layers supplies Dustin's lookahead signal ``s_D`` and the target
verifies on ``I_verify`` (:class:`~jaxspec.dustin.policy.DustinVerify`) -- no second model. KnapSpec's
controller re-plans the skip mask every interval (:func:`~jaxspec.knapspec.policy.knapspec_generate`).

Rule: the planner never skips the Attention of a draft SRH layer. The KnapSpec DP is run with those
layers in ``KnapSpecConfig.keep_attention`` (the skip transition is removed for those sub-layers, so the
DP stays the same exact recursion over a smaller item set, tested against exhaustive search), so every
plan executes the layers the signal is read from and the signal means the same thing in every plan
(the same layers and heads as profiled), with nothing traced or recompiled per plan.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from jaxspec.config import ModelConfig
from jaxspec.dustin.config import DustinConfig
from jaxspec.dustin.policy import dustin_policies
from jaxspec.knapspec.dp import check_keep_attention
from jaxspec.knapspec.latency import LatencyModel
from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_generate


def srh_keep_attention(dustin: DustinConfig) -> tuple:
    """The layers whose Attention every plan must execute: the draft SRH layers when the signal is used."""
    return tuple(dustin.draft_layers) if dustin.uses_draft_signal else ()


def knapspec_dustin_config(knapspec: KnapSpecConfig, dustin: DustinConfig, target_config: ModelConfig) -> KnapSpecConfig:
    """``knapspec`` with the draft SRH layers added to ``keep_attention`` and early exit off
    (``DustinSelfDraft`` drafts every token of the round, so the grid search models no exit); raises
    ``ValueError`` naming an SRH layer or head outside the model."""
    dustin.check_models(target_config, target_config)
    keep = check_keep_attention(tuple(knapspec.keep_attention) + srh_keep_attention(dustin), target_config.num_layers)
    return dataclasses.replace(knapspec, keep_attention=keep, early_exit=None)


def knapspec_dustin_generate(target_params, target_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                             dustin: DustinConfig, latency: Optional[LatencyModel] = None,
                             knapspec: KnapSpecConfig = KnapSpecConfig(), **kwargs):
    """KnapSpec plans + Dustin verification: :func:`~jaxspec.knapspec.policy.knapspec_generate` with
    ``DustinSelfDraft`` / ``DustinVerify`` of ``dustin`` (a self-draft config: ``draft_layers`` are target
    layers) and :func:`knapspec_dustin_config`. Other keywords go to ``knapspec_generate`` (``engine``,
    ``max_new_tokens``, ``warmup``, ``planner``, ...). ``metrics["keep_attention"]`` lists the layers kept.

    A plain-decoding stretch (gamma* = 0, or the measured arbitration choosing AR) does not update the
    verify state, so the first round after it scores ``s_T`` with the query saved by the last speculative
    round (an older token's; the selection is still a valid one)."""
    knap = knapspec_dustin_config(knapspec, dustin, target_config)
    draft, verify = dustin_policies(dustin, target_config)
    result = knapspec_generate(target_params, target_config, prompts, latency=latency, knapspec=knap,
                               draft_policy=draft, verify_policy=verify, **kwargs)
    result.metrics["keep_attention"] = list(knap.keep_attention)
    return result


__all__ = ["knapspec_dustin_config", "knapspec_dustin_generate", "srh_keep_attention"]
