"""Helpers shared by the Dustin commands: list options, the model pair, the task splits."""
from __future__ import annotations

from typing import List, Tuple

from experiments.common import check_skip_ranges, load_model_timed


# ---------------------------------------------------------------------------- shared helpers
def parse_ints(text: str, what: str) -> List[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected comma-separated integers") from None
    if not values:
        raise ValueError(f"{what} is empty")
    return values


def parse_floats(text: str, what: str) -> List[float]:
    try:
        return [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected comma-separated numbers") from None


def check_budgets(text: str) -> List[int]:
    from jaxspec.dustin.config import check_budget

    return [check_budget(b) for b in parse_ints(text, "--budgets")]


def load_pair(args):
    """(target, draft or None, skip mask or None) from --model and --draft / --draft-skip."""
    from jaxspec.decoding.policies import parse_skip_spec
    from jaxspec.decoding.speculative import check_compatible

    if bool(args.draft) == bool(args.draft_skip):
        raise ValueError("give exactly one of --draft SOURCE (separate draft) or --draft-skip SPEC (self-draft)")
    if args.draft_skip:
        check_skip_ranges(args.draft_skip, "--draft-skip")
    target = load_model_timed(args.model, args.dtype)
    if target.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; the needle tasks need one")
    draft = mask = None
    if args.draft:
        draft = load_model_timed(args.draft, args.dtype)
        check_compatible(target.config, draft.config, target.tokenizer, draft.tokenizer)
    else:
        mask = parse_skip_spec(args.draft_skip, target.config.num_layers)
    return target, draft, mask


def build_task_splits(tokenizer, args, kinds, lengths, depths):
    """(calibration, evaluation) suites from --source over disjoint haystack parts and seeds."""
    from jaxspec.data import build_splits
    from jaxspec.data.corpus import load_haystack

    haystack = load_haystack(args.source, progress=False) if any(k != "kv_retrieval" for k in kinds) else None
    return build_splits(tokenizer, haystack, kinds=kinds, context_lengths=lengths, depths=depths,
                        calibration_samples=args.samples, evaluation_samples=args.samples, seed=args.task_seed,
                        source=args.source)


def task_args(args) -> Tuple[List[int], List[str], List[int], List[float]]:
    """``--budgets``, ``--kinds``, ``--lengths``, ``--depths`` of the commands that build needle tasks, checked."""
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    return (check_budgets(args.budgets), kinds, parse_ints(args.lengths, "--lengths"),
            parse_floats(args.depths, "--depths"))
