"""Dustin: draft-augmented sparse verification (docs/methods.md §3).

* :mod:`~jaxspec.dustin.config` -- :class:`DustinConfig` (budget, sinks, window, m, SRH layers and
  heads, mode hybrid / target / draft), the supported budgets;
* :mod:`~jaxspec.dustin.signals` -- target historical ``s_T`` and draft lookahead ``s_D``;
* :mod:`~jaxspec.dustin.selection` -- ``I_verify`` (sinks + window, top-m by ``s_D``, fill by ``s_T``);
* :mod:`~jaxspec.dustin.arr` -- attention recall rate (exact, from a full-KV verification);
* :mod:`~jaxspec.dustin.srh` -- semantic retrieval heads from needle-in-a-haystack runs;
* :mod:`~jaxspec.dustin.search` -- calibration rounds, Algorithm 1, :class:`DustinProfile` (JSON);
* :mod:`~jaxspec.dustin.policy` -- the engine's draft and verify policies;
* :mod:`~jaxspec.dustin.self_speculative` -- KnapSpec plans + Dustin verification (a self-draft whose plans
  keep the SRH layers' attention executed; docs/methods.md §5.5).
"""

from jaxspec.dustin.config import MODES, SUPPORTED_BUDGETS, BudgetError, DustinConfig, check_budget, default_window
from jaxspec.dustin.policy import DustinDraft, DustinSelfDraft, DustinVerify, dustin_policies
from jaxspec.dustin.selection import select_for_config, select_verify_indices
from jaxspec.dustin.signals import DraftSignals, draft_signal, target_signal

__all__ = [
    "MODES", "SUPPORTED_BUDGETS", "BudgetError", "DustinConfig", "check_budget", "default_window",
    "DustinDraft", "DustinSelfDraft", "DustinVerify", "dustin_policies",
    "select_for_config", "select_verify_indices",
    "DraftSignals", "draft_signal", "target_signal",
]
