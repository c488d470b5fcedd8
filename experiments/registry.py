"""Where experiments and decoding methods register, so no module has to know the others.

* An **experiment module** (one of :data:`EXPERIMENT_MODULES`) defines ``register(subparsers)``
  adding its ``python -m experiments.run NAME`` sub-commands; :func:`load_experiment_modules`
  imports every one and returns them.
* A **method** of ``generate --method NAME`` beyond ``ar`` / ``sd`` is one :func:`register_method`
  call in the module that implements it (``experiments.knapspec.self_spec``: knapspec, clasp, static-skip;
  ``experiments.dustin_quality``: dustin, streaming, snapkv, quest, magicdec), plus one
  :func:`register_method_arguments` call adding its family's options to ``generate``.

This module imports no other experiment module at import time; everything else imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from typing import Any, Callable, Dict, FrozenSet, List, Tuple

#: every module with experiments, in the order ``--help`` lists them
EXPERIMENT_MODULES: Tuple[str, ...] = (
    "experiments.generate",  # generate, demo
    "experiments.parity",  # parity
    "experiments.decode_speed",  # bench-decode, bench-skip, bench-plain, bench-sd
    "experiments.kernels",  # attention-device-time, bench-attention, bench-selection, bench-scoring
    "experiments.kernel_explore",  # kernel-explore
    "experiments.dustin_quality",  # dustin-profile, dustin-m-bounds, dustin-quality; the sparse methods
    "experiments.dustin_speed",  # dustin-speed
    "experiments.pair_speed",  # pair-speed
    "experiments.choice_table",  # choice-table (from pair-speed or knapspec results)
    "experiments.knapspec",  # knapspec, bench-plan, reprice-tpt; the knapspec / clasp / static-skip methods
    "experiments.suite",  # suite
)


#: options of ``generate`` that plain speculative decoding (``--method sd``) reads; a registered
#: method names the ones it reads too in :attr:`Method.takes` (the others are refused for it)
SPECULATIVE_OPTIONS = ("draft", "draft_skip", "gamma", "profile", "fixed_tau")


def no_validation(args: argparse.Namespace) -> None:
    """The default :attr:`Method.validate`: nothing to check before loading."""


def no_report(out: Dict[str, Any], row: Dict[str, Any]) -> None:
    """The default :attr:`Method.report`: nothing beyond the shared table."""


def gamma_reserve(args: argparse.Namespace) -> int:
    """The default :attr:`Method.reserve`: cache slots a round needs beyond the new tokens."""
    return args.gamma + 2 if args.gamma else 0


@dataclasses.dataclass(frozen=True)
class Method:
    """One ``generate --method NAME``.

    ``run(args, model, prompts, sampling, stops, out)`` decodes and returns a result with
    ``rows()``, ``num_generated``, ``tokens_per_s``, ``timings`` and ``metrics`` (a
    :class:`~jaxspec.decoding.speculative.SpeculativeResult`); it fills ``out`` with its own
    fields. ``validate(args)`` runs before any model loads and raises ``ValueError``.
    ``family`` names the option group (:func:`register_method_arguments`) the method reads: the
    group's options are refused for methods of other families. ``takes``: the
    :data:`SPECULATIVE_OPTIONS` it reads. ``reserve(args)``: cache slots needed beyond prompt +
    new tokens (checked against the model's context before decoding). ``report(out, row)`` adds
    the method's columns to the shared table's ``row`` and prints its own tables. ``also``: other
    families whose options the method reads too (``knapspec-dustin``: KnapSpec's and Dustin's).
    """

    name: str
    run: Callable[..., Any]
    family: str
    validate: Callable[[argparse.Namespace], None] = no_validation
    takes: FrozenSet[str] = frozenset()
    reserve: Callable[[argparse.Namespace], int] = gamma_reserve
    report: Callable[[Dict[str, Any], Dict[str, Any]], None] = no_report
    also: FrozenSet[str] = frozenset()


METHODS: Dict[str, Method] = {}
#: family -> the function adding its options (an argument group) to ``generate``
METHOD_ARGUMENTS: Dict[str, Callable[[argparse.ArgumentParser], None]] = {}


def register_method(method: Method) -> Method:
    if method.name in ("ar", "sd") or method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    unknown = sorted(method.takes - set(SPECULATIVE_OPTIONS))
    if unknown:
        raise ValueError(f"method {method.name!r} takes unknown options {unknown}; known: {SPECULATIVE_OPTIONS}")
    METHODS[method.name] = method
    return method


def register_method_arguments(family: str, add_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    """``add_arguments(parser)`` adds the options of one method family to ``generate``."""
    METHOD_ARGUMENTS[family] = add_arguments


def family_defaults(family: str) -> Dict[str, Any]:
    """``{dest: default}`` of the options of ``family`` (to tell which ones a command line set)."""
    parser = argparse.ArgumentParser(add_help=False)
    METHOD_ARGUMENTS[family](parser)
    return vars(parser.parse_args([]))


def method(name: str) -> Method:
    load_experiment_modules()
    if name not in METHODS:
        raise ValueError(f"unknown --method {name!r}; valid: {', '.join(method_names())}")
    return METHODS[name]


def method_names() -> List[str]:
    load_experiment_modules()
    return ["ar", "sd", *METHODS]


def load_experiment_modules() -> List[Any]:
    """Import every experiment module (each registers its methods on import); returns them."""
    return [importlib.import_module(name) for name in EXPERIMENT_MODULES]
