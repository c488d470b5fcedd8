"""Measured arbitration between speculative rounds and plain decoding (docs/methods.md §5.2).

:func:`measured_arbitration` is the one rule, shared by KnapSpec's driver (after a plan that drafts,
:class:`~jaxspec.knapspec.policy.KnapSpecController`) and :class:`MeasuredChoiceController` (any
speculative method): on the live sequence, run a few speculative rounds, then as many plain
autoregressive steps (both commit real tokens), and keep the faster in tokens committed per second.
Both probes have fixed shapes (``max_rounds`` and the plain step count are traced), so nothing
compiles in a timed run whichever wins, and a method that does not pay at this context and batch
costs at most its probe.

:class:`MeasuredChoiceController` makes the choice per ``(context, batch)``: the key is the active
row count and the power-of-two bucket of the mean context length at the probe. A decision of a timed
run is remembered by the controller object, so a later run at the same key skips the probe (the
warm-up run's probe timings include compiles and are never remembered); ``reprobe_rounds`` probes
again after that many rounds, as the context grows.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from jaxspec.decoding.contract import Chunk, ScriptedController


def measured_arbitration(run, speculative: Callable, plain: Callable, *, rounds: int,
                         ar_model_rate: Optional[Callable[[int], float]] = None):
    """Generator (``yield from`` it inside a :class:`~jaxspec.decoding.contract.ScriptedController`):
    ``speculative()`` / ``plain()`` are generators that run the two probes (yielding chunks) and return
    the rounds / steps they ran. Returns ``(probe, units)``: ``probe`` is ``None`` when every row finished
    during the speculative probe, else a dict with both rates and ``"choice"`` (``"speculative"`` or
    ``"ar"``); ``units`` the rounds + steps run. ``ar_model_rate(active_rows)``: a predicted
    plain-decoding rate; the better of it and the measured one is used (a short probe's fixed per-call
    cost weighs more on a few cheap AR steps than on the longer speculative rounds)."""
    active = int(np.sum(~np.asarray(run.state.done)))
    n0, t0 = run.committed_total(), time.perf_counter()
    spec_units = yield from speculative()
    n1, t1 = run.committed_total(), time.perf_counter()
    if run.finished():
        return None, spec_units
    plain_units = yield from plain()
    n2, t2 = run.committed_total(), time.perf_counter()
    spec_rate, ar_measured = (n1 - n0) / max(t1 - t0, 1e-9), (n2 - n1) / max(t2 - t1, 1e-9)
    ar_model = None if ar_model_rate is None else float(ar_model_rate(active))
    ar_rate = max(ar_measured, ar_model or 0.0)
    probe = {"rounds": int(rounds), "speculative_tokens": n1 - n0, "speculative_s": t1 - t0,
             "ar_tokens": n2 - n1, "ar_s": t2 - t1, "speculative_tokens_per_s": spec_rate,
             "ar_tokens_per_s": ar_rate, "ar_tokens_per_s_measured": ar_measured,
             "ar_tokens_per_s_model": ar_model, "choice": "speculative" if spec_rate >= ar_rate else "ar"}
    return probe, spec_units + plain_units


def remaining_steps(run) -> int:
    """The most tokens an active row still generates (0 when every row finished)."""
    state = run.state
    left = np.asarray(run.engine.max_new_tokens - state.num_out)[~np.asarray(state.done)]
    return int(left.max(initial=0))


def context_bucket(run) -> int:
    """The power of two at or above the active rows' mean context length (prompt + generated)."""
    state = run.state
    active = ~np.asarray(state.done)
    lengths = np.asarray(state.committed)[active] if active.any() else np.asarray(state.committed)
    return int(2 ** int(np.ceil(np.log2(max(float(np.mean(lengths)), 1.0)))))


class MeasuredChoiceController(ScriptedController):
    """Speculation only where it pays: probe ``probe_rounds`` speculative rounds against as many plain
    decoding steps on the live sequence (:func:`measured_arbitration`), then run the rest of the run
    (or ``reprobe_rounds`` rounds, then probe again) in the faster mode. Decisions of timed runs are
    remembered per ``(context bucket, active rows)`` (see the module doc); ``remember=False`` probes
    every run. ``metrics["arbitration"]`` lists the probes and the choices."""

    def __init__(self, probe_rounds: int = 8, reprobe_rounds: Optional[int] = None, remember: bool = True):
        if isinstance(probe_rounds, bool) or not isinstance(probe_rounds, int) or probe_rounds < 1:
            raise ValueError(f"probe_rounds={probe_rounds!r} must be an integer >= 1")
        if reprobe_rounds is not None and (isinstance(reprobe_rounds, bool) or not isinstance(reprobe_rounds, int)
                                           or reprobe_rounds < 1):
            raise ValueError(f"reprobe_rounds={reprobe_rounds!r} must be None (probe once) or an integer >= 1")
        self.probe_rounds, self.reprobe_rounds, self.remember = probe_rounds, reprobe_rounds, remember
        self.decisions: Dict[Tuple[int, int], str] = {}

    def _speculative(self, run, rounds: int):
        # a bounded chunk, never None: the traced round limit keeps one compile for probes and stretches
        yield Chunk(rounds=int(rounds))
        return run.last_chunk

    def _plain(self, run, steps: int):
        steps = min(int(steps), remaining_steps(run))
        if steps <= 0:
            return 0
        yield Chunk(plain_steps=steps)
        return steps

    def chunks(self, run):
        self.events = []
        limit = run.engine.max_new_tokens  # more rounds than any row can need
        while not run.finished():
            key = (context_bucket(run), int(np.sum(~np.asarray(run.state.done))))
            choice, probe = self.decisions.get(key) if self.remember else None, None
            if choice is None:
                probe, _ = yield from measured_arbitration(
                    run, lambda: self._speculative(run, self.probe_rounds),
                    lambda: self._plain(run, self.probe_rounds), rounds=self.probe_rounds)
                if probe is None:  # every row finished in the speculative probe
                    break
                choice = probe["choice"]
                if self.remember and not run.warmup and not run.profiling:
                    self.decisions[key] = choice
            self.events.append({"context_bucket": key[0], "active_rows": key[1], "choice": choice,
                                "probe": probe, "remembered": probe is None})
            span = limit if self.reprobe_rounds is None else self.reprobe_rounds
            if run.finished():
                break
            if choice == "speculative":
                yield from self._speculative(run, span)
            else:
                yield from self._plain(run, span if self.reprobe_rounds is not None else remaining_steps(run))
        if run.warmup:  # compile both modes whichever the probe chose
            if not run.finished():
                yield Chunk(plain_steps=1)

    def finish(self, run) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        counters = run.counters
        choices = [event["choice"] for event in self.events]
        metrics = {"arbitration": {"probe_rounds": self.probe_rounds, "reprobe_rounds": self.reprobe_rounds,
                                   "events": self.events,
                                   "choice": choices[-1] if choices else "speculative"},
                   "ar_steps": counters.plain_steps, "ar_tokens": counters.plain_tokens}
        return metrics, {}


__all__ = ["MeasuredChoiceController", "context_bucket", "measured_arbitration", "remaining_steps"]
