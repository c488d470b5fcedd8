"""KnapSpec stage 2: grid search over (candidate skip set S, gamma) maximising TPT (docs/methods.md §4.2).

``TPT(S, g) = E[tokens | alpha_S, g] / (g * t_draft(S) + t_target)`` with
``E[tokens] = (1 - a^(g+1)) / (1 - a)`` (``g + 1`` when ``a = 1``; ``g = 0`` is plain decoding:
one token per target step, ``TPT = 1 / t_target``), ``t_draft(S) = n_attn(S) t_attn(n) +
n_mlp(S) t_mlp + t_token`` (executed sub-layers) and ``t_target = L (t_attn(n) + t_mlp) +
t_token`` (verifying ``g + 1`` tokens costs about one decode step). ``t_token`` (the latency
model's ``c0``: embeddings, final norm, LM head) is paid by every forward whatever is skipped;
docs/methods.md §4.2 has no such term (``t_token = 0`` reproduces it). ``v`` (the latency model's
verification row cost) makes verification cost ``t_target (1 + v g)`` instead of one step
(``v = 0``, docs/methods.md §4.2): a compute-bound device pays for every verified row.

Objectives (``objective=``):

* ``"tpt"`` (default, KnapSpec): the above;
* ``"tpl"`` (the paper's tokens-per-layer ablation, the objective of earlier self-speculative
  methods): the same expression with every sub-layer costing 1 and no per-token term, i.e.
  ``E[tokens] / (g * executed sub-layers + 2L)`` -- hardware- and context-agnostic.

**Early-exit-aware TPT** (beyond docs/methods.md §4.2; ``choose_plan(exit_stats=(p_c, p_ac))``): the draft
stops once a drafted token's probability is below the early-exit threshold (0.7), so a round
does not run ``g`` draft forwards nor commit ``(1 - a^(g+1)) / (1 - a)`` tokens. With ``p_c`` the
share of reference tokens on which the candidate is confident and ``p_ac`` the share on which it
is confident *and* agrees with the target (both measured by the DP on the reference tokens),
treating positions as independent: ``E[drafts] = (1 - p_c^g) / (1 - p_c)`` (drafting continues
past a confident token) and ``E[tokens] = 1 + a (1 - p_ac^g) / (1 - p_ac)`` (draft ``i`` is
reached and accepted when drafts ``1..i-1`` were confident and accepted). Without early exit
(``p_c = 1``, ``p_ac = a``) both reduce to the formulas above.

The full model (no skipped sub-layer) is excluded unless it is the only candidate. Ties go to
the first candidate (ascending skipped weight) and the smallest gamma, as in the official code.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import numpy as np

from jaxspec.knapspec.latency import LatencyModel

OBJECTIVES = ("tpt", "tpl")
#: The official grid: gamma in 0..17.
GAMMA_GRID = tuple(range(18))


def expected_tokens(alpha, gamma):
    """``(1 - a^(g+1)) / (1 - a)``, with the ``a -> 1`` limit ``g + 1`` (array-friendly)."""
    a = np.asarray(alpha, np.float64)
    g = np.asarray(gamma, np.float64)
    one = a >= 1.0
    safe = np.where(one, 0.5, a)
    geometric = (1.0 - safe ** (g + 1.0)) / (1.0 - safe)
    return np.where(one, g + 1.0, geometric)


def _geometric_sum(p, gamma):
    """``1 + p + ... + p^(g-1) = (1 - p^g) / (1 - p)`` (``g`` when ``p = 1``; 0 when ``g = 0``)."""
    p = np.asarray(p, np.float64)
    g = np.asarray(gamma, np.float64)
    one = p >= 1.0
    safe = np.where(one, 0.5, p)
    return np.where(one, g, (1.0 - safe ** g) / (1.0 - safe))


def expected_tokens_exit(alpha, p_ac, gamma):
    """Tokens a round commits with early exit: ``1 + a (1 - p_ac^g) / (1 - p_ac)`` (module doc)."""
    return 1.0 + np.asarray(alpha, np.float64) * _geometric_sum(p_ac, gamma)


def expected_drafts(p_c, gamma):
    """Draft forwards a round runs with early exit: ``(1 - p_c^g) / (1 - p_c)``."""
    return _geometric_sum(p_c, gamma)


def executed_counts(mask) -> Tuple[np.ndarray, np.ndarray]:
    """Executed Attention and MLP sub-layers of ``[..., L, 2]`` skip masks."""
    mask = np.asarray(mask, bool)
    return (~mask[..., 0]).sum(-1), (~mask[..., 1]).sum(-1)


def draft_time(mask, t_attn: float, t_mlp: float, t_token: float = 0.0):
    """One draft forward: executed sub-layers plus the per-token constant."""
    n_attn, n_mlp = executed_counts(mask)
    return n_attn * float(t_attn) + n_mlp * float(t_mlp) + float(t_token)


def target_time(num_layers: int, t_attn: float, t_mlp: float, t_token: float = 0.0) -> float:
    """One target forward (a decode step, or the verification of gamma + 1 tokens)."""
    return float(num_layers) * (float(t_attn) + float(t_mlp)) + float(t_token)


def tpt(alpha, gamma, t_draft, t_target, v: float = 0.0, a: float = 1.0, p_c=None, p_ac=None,
        plain: Optional[float] = None):
    """Tokens per unit time of one round (broadcasting over arrays); verifying ``gamma + 1`` rows
    costs ``t_target (a + v gamma)`` (``a``: the target's unmasked one-row forward in modelled
    steps); gamma = 0, plain decoding, costs ``plain t_target`` a token (``LatencyModel.plain_ratio``:
    the decode loop's own step; None = ``a``). ``p_c``, ``p_ac``: the early-exit statistics (module
    doc); None = every round drafts ``gamma`` tokens."""
    g = np.asarray(gamma, np.float64)
    if p_c is None:
        tokens, drafts = expected_tokens(alpha, gamma), g
    else:
        tokens, drafts = expected_tokens_exit(alpha, p_ac, gamma), expected_drafts(p_c, gamma)
    factor = float(a) + float(v) * g
    if plain is not None:
        factor = np.where(g == 0, float(plain), factor)
    return tokens / (drafts * np.asarray(t_draft, np.float64) + np.asarray(t_target, np.float64) * factor)


@dataclasses.dataclass
class Plan:
    mask: np.ndarray  # [L, 2] bool, True = skip
    gamma: int  # the TPT-optimal draft length (0 = plain decoding predicted best)
    score: float  # objective value at (mask, gamma)
    index: int  # candidate index
    alpha: float
    objective: str
    n: float  # context length t_attn was evaluated at
    t_attn: float
    t_mlp: float
    table: np.ndarray  # [C, G] objective of every (candidate, gamma); -inf for excluded candidates
    gammas: Tuple[int, ...]
    t_token: float = 0.0
    verify_row_cost: float = 0.0
    target_ratio: float = 1.0  # LatencyModel.a
    plain_ratio: Optional[float] = None  # LatencyModel.plain_ratio (gamma = 0); None = target_ratio
    p_c: Optional[float] = None  # early-exit statistics of the chosen candidate (exit-aware TPT)
    p_ac: Optional[float] = None

    @property
    def predicted_tpt(self) -> float:
        """TPT of the chosen (mask, gamma) under the latency model (whatever the objective)."""
        num_layers = self.mask.shape[0]
        return float(tpt(self.alpha, self.gamma, draft_time(self.mask, self.t_attn, self.t_mlp, self.t_token),
                         target_time(num_layers, self.t_attn, self.t_mlp, self.t_token), self.verify_row_cost,
                         self.target_ratio, self.p_c, self.p_ac, self.plain_ratio))

    def summary(self) -> dict:
        mask = np.asarray(self.mask, bool)
        return {"gamma": int(self.gamma), "score": float(self.score), "objective": self.objective,
                "alpha": float(self.alpha), "n": float(self.n), "index": int(self.index),
                "t_attn": float(self.t_attn), "t_mlp": float(self.t_mlp), "t_token": float(self.t_token),
                "verify_row_cost": float(self.verify_row_cost), "target_ratio": float(self.target_ratio),
                "plain_ratio": self.plain_ratio,
                "skip_attn": np.nonzero(mask[:, 0])[0].tolist(), "skip_mlp": np.nonzero(mask[:, 1])[0].tolist(),
                "predicted_tpt": self.predicted_tpt, "p_c": self.p_c, "p_ac": self.p_ac}


def objective_table(masks, alphas, t_attn: float, t_mlp: float, gammas: Sequence[int] = GAMMA_GRID,
                    objective: str = "tpt", t_token: float = 0.0, verify_row_cost: float = 0.0,
                    target_ratio: float = 1.0, exit_stats=None, plain_ratio: Optional[float] = None) -> np.ndarray:
    """``[C, G]`` objective of every (candidate, gamma)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}; valid: {OBJECTIVES}")
    masks = np.asarray(masks, bool)
    num_layers = masks.shape[1]
    if objective == "tpl":
        t_attn = t_mlp = 1.0
        t_token = verify_row_cost = 0.0
        target_ratio, plain_ratio = 1.0, None
    g = np.asarray(gammas, np.float64)[None, :]
    t_d = draft_time(masks, t_attn, t_mlp, t_token)[:, None]
    t_t = target_time(num_layers, t_attn, t_mlp, t_token)
    p_c = p_ac = None
    if exit_stats is not None and objective == "tpt":
        p_c, p_ac = (np.asarray(x, np.float64).reshape(-1)[:, None] for x in exit_stats)
    return tpt(np.asarray(alphas, np.float64)[:, None], g, t_d, t_t, verify_row_cost, target_ratio, p_c, p_ac,
               plain_ratio)


def choose_plan(masks, alphas, latency: Union[LatencyModel, Tuple[float, float]], n: float = 0.0, *,
                gammas: Sequence[int] = GAMMA_GRID, objective: str = "tpt", exclude_full: bool = True,
                exit_stats=None) -> Plan:
    """Grid search over (candidate, gamma). ``latency`` is a :class:`LatencyModel` (evaluated at
    context ``n``) or explicit ``(t_attn, t_mlp)``, ``(t_attn, t_mlp, t_token)`` or
    ``(t_attn, t_mlp, t_token, v)``. ``exit_stats=(p_c [C], p_ac [C])``: the early-exit-aware
    TPT (module doc; objective ``"tpt"`` only)."""
    masks = np.asarray(masks, bool)
    alphas = np.asarray(alphas, np.float64).reshape(-1)
    if masks.ndim != 3 or masks.shape[2] != 2 or masks.shape[0] != alphas.shape[0] or masks.shape[0] == 0:
        raise ValueError(f"masks must be [C, L, 2] with C = len(alphas) > 0; got {masks.shape} and {alphas.shape}")
    gammas = tuple(int(g) for g in gammas)
    if not gammas or min(gammas) < 0:
        raise ValueError(f"gammas must be non-negative integers; got {gammas}")
    if isinstance(latency, LatencyModel):
        t_attn, t_mlp, t_token, v = latency.t_attn(n), latency.t_mlp(), latency.t_token(n), latency.v
        a, plain = latency.a, latency.plain_ratio
    else:
        values = tuple(float(x) for x in latency)
        if len(values) not in (2, 3, 4):
            raise ValueError(f"latency must be a LatencyModel or (t_attn, t_mlp[, t_token[, v]]); got {latency!r}")
        t_attn, t_mlp, t_token, v = values + (0.0,) * (4 - len(values))
        a, plain = 1.0, None
    if exit_stats is not None:
        exit_stats = tuple(np.asarray(x, np.float64).reshape(-1) for x in exit_stats)
        if len(exit_stats) != 2 or any(x.shape != alphas.shape for x in exit_stats):
            raise ValueError(f"exit_stats must be (p_c, p_ac), each of {alphas.shape[0]} values")
    table = objective_table(masks, alphas, t_attn, t_mlp, gammas, objective, t_token, v, a, exit_stats, plain)
    is_full = ~masks.any(axis=(1, 2))
    if exclude_full and not is_full.all():
        table = np.where(is_full[:, None], -np.inf, table)
    flat = int(np.argmax(table))  # first maximum: candidate-major, then gamma
    index, g_index = divmod(flat, len(gammas))
    return Plan(mask=masks[index], gamma=gammas[g_index], score=float(table[index, g_index]), index=index,
                alpha=float(alphas[index]), objective=objective, n=float(n), t_attn=float(t_attn), t_mlp=float(t_mlp),
                table=table, gammas=gammas, t_token=float(t_token),
                verify_row_cost=float(v) if objective == "tpt" else 0.0,
                target_ratio=float(a) if objective == "tpt" else 1.0,
                plain_ratio=plain if objective == "tpt" else None,
                p_c=float(exit_stats[0][index]) if exit_stats is not None and objective == "tpt" else None,
                p_ac=float(exit_stats[1][index]) if exit_stats is not None and objective == "tpt" else None)


__all__ = ["GAMMA_GRID", "OBJECTIVES", "Plan", "choose_plan", "draft_time", "executed_counts", "expected_drafts",
           "expected_tokens", "expected_tokens_exit",
           "objective_table", "target_time", "tpt"]


# ---------------------------------------------------------------------------- planner contract
@runtime_checkable
class Planner(Protocol):
    """Chooses a (skip set, gamma) plan from a reference window; KnapSpec's, CLaSp's and the static
    skip set's drivers call it (:class:`~jaxspec.knapspec.controller.KnapSpecController`)."""

    name: str

    def plan(self, target_params, config, cache, tokens, token_mask, prefix_len, n: float):
        """``tokens``/``token_mask [B, R]`` (the reference window), ``prefix_len [B]`` (its start in
        ``cache``), ``n`` (the context ``t_attn`` is evaluated at) -> ``(Plan, Candidates or None,
        (w_attn, w_mlp))``."""

    def latency_model(self) -> Optional[LatencyModel]:
        """The latency model the planner predicts with (the driver's arbitration uses it), or None."""

    def reference_cost(self, config, n: float) -> Optional[float]:
        """Predicted seconds of one plan per reference token of each row, or None (no prediction:
        the planning allowance does not cap the window)."""


class PlannerBase:
    """Defaults of :class:`Planner`: no latency model, no cost prediction."""

    def latency_model(self) -> Optional[LatencyModel]:
        return None

    def reference_cost(self, config, n: float) -> Optional[float]:
        return None
