"""``DustinConfig``: every choice of Dustin's sparse verification (docs/methods.md §3) as a config value.

A frozen (hashable) dataclass, so it is a static argument of the jitted engine loop.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

#: KV budgets with static shapes (docs/methods.md §3.2). Any other budget is refused.
SUPPORTED_BUDGETS = (128, 256, 512, 1024, 2048)
#: Dustin-H (hybrid), Dustin-T (target signal only), Dustin-D (draft signal only), docs/methods.md §3.6.
MODES = ("hybrid", "target", "draft")
#: what the draft's attention reads of its own cache (docs/methods.md §5.x "sparse draft KV"): everything, a
#: StreamingLLM view (sinks + window), or the previous round's I_verify plus a recent window.
DRAFT_KV = ("full", "streaming", "verify-set")
#: How the SRH scoring reads a layer's keys (docs/methods.md §3.1): one product per KV group that an SRH reads, on
#: that group's slice of the keys; or one product over every KV head of the layer with the probe rows packed per
#: head (zero rows where no SRH reads), which reads the unused heads too but no slice of the cache; or the
#: Pallas logits kernel, which reads each used KV head's keys in place (no slice, no unused heads).
SCORING_LAYOUTS = ("groups", "heads", "pallas")
#: How the hybrid split m is chosen (docs/methods.md §3.7): the profiled m; per round and row by ranking
#: each position by the larger of its two normalised signal masses (max-mass); or per round and row
#: among candidates around the profiled m by the coverage of both signals' mass (coverage); or per round
#: and row m -/+ a step when the two signals' entropies clearly depart from their usual gap (entropy).
M_RULES = ("fixed", "max-mass", "coverage", "entropy")
#: How a decoding loop runs the coverage rule deciding every ``m_every``-th round (docs/methods.md §3.7): one round
#: body that picks deciding or holding with a ``lax.cond`` on the device (the default: on an H100 it costs a round
#: less than unrolling does); or that many rounds per loop iteration, each with its selection chosen at compile time.
M_EVERY_SCHEDULES = ("cond", "unrolled")


class BudgetError(ValueError):
    """A KV budget outside :data:`SUPPORTED_BUDGETS`."""


def check_budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget not in SUPPORTED_BUDGETS:
        raise BudgetError(f"KV budget k={budget!r} is not supported: Dustin budgets are static shapes, one of "
                          f"{', '.join(map(str, SUPPORTED_BUDGETS))}")
    return budget


def default_window(budget: int) -> int:
    """docs/methods.md §3.2 (choice): w = 64 for k >= 256, 32 for k = 128."""
    return 64 if budget >= 256 else 32


@dataclasses.dataclass(frozen=True)
class DustinConfig:
    """Sparse-verification settings for one target–draft pair and one budget.

    Attributes:
      budget: k, history positions the verifier attends to (one of :data:`SUPPORTED_BUDGETS`).
      sinks: s, protected prefix (attention sinks), part of k. the paper: 4.
      window: w, protected most recent history positions, part of k; ``None`` = the paper's default
        (64 for k >= 256, 32 for k = 128).
      m: positions filled from the draft signal (hybrid mode); ``None`` = half of ``k - s - w``.
        Offline profiling (Algorithm 1) chooses it.
      target_layer, target_heads: the target SRH layer and its query heads (the paper: 4 heads).
      draft_layers, draft_heads: the draft SRH layers and, per layer, its query heads.
      mode: ``"hybrid"`` (Dustin-H), ``"target"`` (Dustin-T: m = 0) or ``"draft"``
        (Dustin-D: m = k - s - w).
      draft_kv: what the draft's attention reads of its cache (docs/methods.md §5, "sparse draft KV"):
        ``"full"`` (all of it, the paper), ``"streaming"`` (``sinks`` + the last ``draft_window``
        positions, MagicDec's view) or ``"verify-set"`` (the previous round's ``I_verify`` + the last
        ``draft_window`` positions). K/V writes always go to the full cache, and ``s_D`` is always scored
        over the draft SRH layers' full history.
      draft_window: the recent window of a sparse draft KV; ``None`` = ``k - sinks`` for ``"streaming"``
        (the draft reads k positions, as the verifier) and ``w`` for ``"verify-set"``.
      m_rule: ``"fixed"`` (m as above, every round); hybrid only, per round and row
        (docs/methods.md §3.7): ``"max-mass"`` (top ``k - s - w`` by ``max(p_D, lambda p_T)`` of the
        normalised signals, ``lambda`` = :attr:`m_balance` from the profiled m; one radix selection)
        or ``"coverage"`` (the m among :attr:`m_candidates` whose selection covers the most of both
        signals' mass), or ``"entropy"`` (m, or m -/+ ``m_spread * (k - s - w)`` when the entropy gap
        ``H(p_T) - H(p_D)`` of the normalised signals lies outside ``m_entropy_centre -/+ m_entropy_band``;
        no extra selection).
      m_spread: the coverage rule's candidates are m and m -/+ ``i * m_spread * (k - s - w)`` for
        ``i = 1 .. m_steps``, clipped; the entropy rule's step.
      m_steps: how many steps of the coverage rule's candidate ladder on each side of m (1: m and
        m -/+ one step); the coverage rule only.
      m_entropy_centre, m_entropy_band: the entropy rule's dead zone (docs/methods.md §3.7): m stays the
        profiled m while ``H(p_T) - H(p_D)`` (each entropy divided by the log of the number of positions
        it is taken over) lies within ``centre -/+ band``; above it (the target signal flatter than usual)
        the draft gets the step, below it the target does.
      reselect_every: R, select ``I_verify`` from the signals every R-th round only (docs/methods.md §3.8); in
        between a round reuses the last selection's signal-chosen positions with its own sinks and window, and
        computes no signal and no top-k. 1 = every round (the paper). Rows whose history fits in k always
        select (dense).
      scoring_layout: how the SRH scoring reads a layer's keys (:data:`SCORING_LAYOUTS`, docs/methods.md §3.1):
        ``"groups"`` (one product per KV group an SRH reads, on its slice of the keys) or ``"heads"`` (one product
        over all the layer's KV heads, probe rows packed per head) or ``"pallas"`` (the Pallas logits kernel
        reading each used KV head's keys where they lie: Triton on a GPU, Mosaic on a TPU, interpreted elsewhere).
        The same scores every way.
      m_every: N, the coverage rule decides each row's m every N-th round only (docs/methods.md §3.7); in the
        rounds between, the fixed rule selects with the per-row m it chose last (the same two radix selections
        as the fixed rule, none of the rule's candidate scoring). 1 = every round. A round that reuses its
        selection (``reselect_every``) decides nothing.
      m_every_schedule: how a decoding loop runs the ``m_every`` rounds (:data:`M_EVERY_SCHEDULES`,
        docs/methods.md §3.7): ``"cond"`` (one round body choosing the branch with a ``lax.cond`` on the device,
        whose predicate a GPU reads on the host) or ``"unrolled"`` (the loop runs ``m_every`` rounds per
        iteration, the deciding round and the holding rounds each compiled with its own selection, no
        conditional). The same rounds and tokens either way.
    """

    budget: int = 512
    sinks: int = 4
    window: Optional[int] = None
    m: Optional[int] = None
    target_layer: int = 0
    target_heads: Tuple[int, ...] = (0, 1, 2, 3)
    draft_layers: Tuple[int, ...] = ()
    draft_heads: Tuple[Tuple[int, ...], ...] = ()
    mode: str = "hybrid"
    draft_kv: str = "full"
    draft_window: Optional[int] = None
    m_rule: str = "fixed"
    m_spread: float = 0.1
    m_steps: int = 1
    m_entropy_centre: float = -0.2
    m_entropy_band: float = 0.05
    reselect_every: int = 1
    m_every: int = 1
    scoring_layout: str = "groups"
    m_every_schedule: str = "cond"

    def __post_init__(self):
        check_budget(self.budget)
        object.__setattr__(self, "target_heads", tuple(int(h) for h in self.target_heads))
        object.__setattr__(self, "draft_layers", tuple(int(x) for x in self.draft_layers))
        object.__setattr__(self, "draft_heads", tuple(tuple(int(h) for h in hs) for hs in self.draft_heads))
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; valid: {MODES} (Dustin-H, Dustin-T, Dustin-D)")
        if self.draft_kv not in DRAFT_KV:
            raise ValueError(f"draft_kv={self.draft_kv!r}; valid: {DRAFT_KV}")
        if self.draft_window is not None and (isinstance(self.draft_window, bool) or
                                              not isinstance(self.draft_window, int) or self.draft_window < 1):
            raise ValueError(f"draft_window={self.draft_window!r} must be None (the default) or an integer >= 1")
        if isinstance(self.reselect_every, bool) or not isinstance(self.reselect_every, int) or self.reselect_every < 1:
            raise ValueError(f"reselect_every={self.reselect_every!r} must be an integer >= 1 (1: select every round)")
        if self.scoring_layout not in SCORING_LAYOUTS:
            raise ValueError(f"scoring_layout={self.scoring_layout!r}; valid: {SCORING_LAYOUTS}")
        if self.m_rule not in M_RULES:
            raise ValueError(f"m_rule={self.m_rule!r}; valid: {M_RULES}")
        if isinstance(self.m_every, bool) or not isinstance(self.m_every, int) or self.m_every < 1:
            raise ValueError(f"m_every={self.m_every!r} must be an integer >= 1 (1: the rule decides every round)")
        if self.m_every != 1 and self.m_rule != "coverage":
            raise ValueError(f"m_every={self.m_every} holds the coverage rule's m between its decisions; "
                             f"m_rule={self.m_rule!r} does not use it")
        if self.m_every_schedule not in M_EVERY_SCHEDULES:
            raise ValueError(f"m_every_schedule={self.m_every_schedule!r}; valid: {M_EVERY_SCHEDULES}")
        if isinstance(self.m_spread, bool) or not isinstance(self.m_spread, (int, float)) or not 0 < self.m_spread <= 1:
            raise ValueError(f"m_spread={self.m_spread!r} must be a number in (0, 1]")
        if isinstance(self.m_steps, bool) or not isinstance(self.m_steps, int) or self.m_steps < 1:
            raise ValueError(f"m_steps={self.m_steps!r} must be an integer >= 1")
        if self.m_steps != 1 and self.m_rule != "coverage":
            raise ValueError(f"m_steps={self.m_steps} widens the coverage rule's candidates; m_rule={self.m_rule!r} "
                             f"does not use it")
        for name in ("m_entropy_centre", "m_entropy_band"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1 <= value <= 1:
                raise ValueError(f"{name}={value!r} must be a number in [-1, 1] (entropies are normalised to 0..1)")
        if self.m_entropy_band < 0:
            raise ValueError(f"m_entropy_band={self.m_entropy_band!r} must be >= 0 (the dead zone's half width)")
        if self.m_rule != "fixed" and self.mode != "hybrid":
            raise ValueError(f"m_rule={self.m_rule!r} chooses the hybrid split: it needs mode='hybrid', not "
                             f"{self.mode!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks={self.sinks!r} must be an integer >= 0")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 0):
            raise ValueError(f"window={self.window!r} must be None (the paper's default) or an integer >= 0")
        if self.free_budget < 0:
            raise ValueError(f"sinks={self.sinks} + window={self.window_size} exceed the budget k={self.budget}")
        if self.m is not None and not (isinstance(self.m, int) and 0 <= self.m <= self.free_budget):
            raise ValueError(f"m={self.m!r} must lie in 0..k - s - w = {self.free_budget}")
        if len(self.draft_heads) != len(self.draft_layers):
            raise ValueError(f"draft_heads has {len(self.draft_heads)} entries for {len(self.draft_layers)} "
                             f"draft_layers: one tuple of query heads per draft layer")
        if len(set(self.draft_layers)) != len(self.draft_layers):
            raise ValueError(f"draft_layers {self.draft_layers} repeat a layer")
        if any(len(hs) == 0 for hs in self.draft_heads):
            raise ValueError("every draft layer needs at least one SRH query head")
        if self.mode != "draft" and not self.target_heads:
            raise ValueError(f"mode={self.mode!r} uses the target signal: target_heads must not be empty")
        if self.mode == "draft" and not self.draft_layers:
            raise ValueError("mode='draft' uses the draft signal: give draft_layers and draft_heads")

    # ------------------------------------------------------------------ derived values
    @property
    def window_size(self) -> int:
        return default_window(self.budget) if self.window is None else self.window

    @property
    def free_budget(self) -> int:
        """k - s - w: the positions chosen by the signals."""
        return self.budget - self.sinks - self.window_size

    @property
    def effective_m(self) -> int:
        """Positions taken by the draft signal in this mode."""
        if self.mode == "target" or not self.draft_layers:
            return 0
        if self.mode == "draft":
            return self.free_budget
        return self.free_budget // 2 if self.m is None else self.m

    @property
    def draft_window_size(self) -> int:
        """The recent window a sparse draft KV reads (0 for ``draft_kv="full"``)."""
        if self.draft_kv == "full":
            return 0
        if self.draft_window is not None:
            return self.draft_window
        return self.budget - self.sinks if self.draft_kv == "streaming" else max(self.window_size, 1)

    @property
    def input_aware(self) -> bool:
        """An input-aware rule is in force: hybrid with draft layers and target heads, and a choice to
        make (max-mass and entropy: 0 < m < k - s - w; coverage: more than one candidate). The entropy
        rule keeps Dustin-D's split (m = k - s - w): there the fixed rule reads one signal with one
        selection, and moving m down would double the selection's cost."""
        if self.m_rule == "fixed" or self.mode != "hybrid" or not self.draft_layers or not self.target_heads:
            return False
        if self.m_rule in ("max-mass", "entropy"):
            return 0 < self.effective_m < self.free_budget and (self.m_rule == "max-mass" or len(self.m_candidates) > 1)
        return len(self.m_candidates) > 1

    @property
    def m_balance(self) -> float:
        """max-mass's weight of the target signal, ``(k - s - w - m) / m`` for the profiled m: the
        split m when both signals' sorted masses fall off like ``1 / rank`` (docs/methods.md §3.7)."""
        m = self.effective_m
        return (self.free_budget - m) / m if m > 0 else float("inf")

    @property
    def m_candidates(self) -> Tuple[int, ...]:
        """The coverage rule's candidate m values, the profiled m first (ties keep it), then m - i step and
        m + i step for i = 1 .. :attr:`m_steps`; the entropy rule's m, m - step and m + step."""
        m, free = self.effective_m, self.free_budget
        step = int(round(self.m_spread * free))
        out = []
        for value in (m, *(m + sign * i * step for i in range(1, self.m_steps + 1) for sign in (-1, 1))):
            value = min(max(value, 0), free)
            if value not in out:
                out.append(value)
        return tuple(out)

    @property
    def uses_target_signal(self) -> bool:
        return self.effective_m < self.free_budget or self.input_aware

    @property
    def uses_draft_signal(self) -> bool:
        return self.effective_m > 0 or self.input_aware

    @property
    def target_probe_heads(self) -> Tuple[Tuple[int, int], ...]:
        return tuple((self.target_layer, h) for h in self.target_heads)

    @property
    def draft_probe_heads(self) -> Tuple[Tuple[int, int], ...]:
        return tuple((layer, h) for layer, hs in zip(self.draft_layers, self.draft_heads) for h in hs)

    def replace(self, **changes) -> "DustinConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {"budget": self.budget, "sinks": self.sinks, "window": self.window, "m": self.m,
                "target_layer": self.target_layer, "target_heads": list(self.target_heads),
                "draft_layers": list(self.draft_layers), "draft_heads": [list(h) for h in self.draft_heads],
                "mode": self.mode,
                **({"draft_kv": self.draft_kv, "draft_window": self.draft_window} if self.draft_kv != "full" else {}),
                **({"m_rule": self.m_rule, "m_spread": self.m_spread} if self.m_rule != "fixed" else {}),
                **({"m_steps": self.m_steps} if self.m_steps != 1 else {}),
                **({"m_entropy_centre": self.m_entropy_centre, "m_entropy_band": self.m_entropy_band}
                   if self.m_rule == "entropy" else {}),
                **({"reselect_every": self.reselect_every} if self.reselect_every != 1 else {}),
                **({"m_every": self.m_every} if self.m_every != 1 else {}),
                **({"m_every_schedule": self.m_every_schedule} if self.m_every_schedule != "cond" else {}),
                **({"scoring_layout": self.scoring_layout} if self.scoring_layout != "groups" else {})}

    @classmethod
    def from_dict(cls, data) -> "DustinConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a Dustin config must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown Dustin config fields {unknown}; known: {sorted(names)}")
        data = dict(data)
        for key in ("target_heads", "draft_layers"):
            if key in data:
                data[key] = tuple(data[key])
        if "draft_heads" in data:
            data["draft_heads"] = tuple(tuple(h) for h in data["draft_heads"])
        return cls(**data)

    def check_models(self, target_config=None, draft_config=None) -> None:
        """Raise if a layer or head is out of range for the given model configs."""
        def check(config, layer, heads, what):
            if not 0 <= layer < config.num_layers:
                raise ValueError(f"{what} layer {layer} out of range: the model has layers 0..{config.num_layers - 1}")
            bad = [h for h in heads if not 0 <= h < config.num_heads]
            if bad:
                raise ValueError(f"{what} heads {bad} out of range: the model has query heads "
                                 f"0..{config.num_heads - 1}")

        if target_config is not None and self.uses_target_signal:
            check(target_config, self.target_layer, self.target_heads, "target SRH")
        if draft_config is not None and self.uses_draft_signal:
            for layer, heads in zip(self.draft_layers, self.draft_heads):
                check(draft_config, layer, heads, "draft SRH")
