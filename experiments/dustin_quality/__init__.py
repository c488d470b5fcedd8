"""Dustin (docs/methods.md §3) from the command line: sparse-verification methods, the offline profile, quality.

* ``generate --method dustin | streaming | snapkv | quest | magicdec --budget K`` -- registered in
  :data:`experiments.registry.METHODS`. Every method runs in the same speculative engine
  with the same draft (``--draft SOURCE`` or a self-draft ``--draft-skip SPEC``) and gamma:

  - ``dustin``: Dustin verification (``--dustin-mode hybrid|target|draft`` = Dustin-H/T/D), the
    per-budget config of ``--dustin-profile FILE`` (written by ``dustin-profile``), else an
    unprofiled default (labelled in the JSON); with ``--draft-skip SPEC --draft-kv streaming`` the
    self-draft reads a StreamingLLM view of the target cache (MagicDec's self-draft) and still gives the
    lookahead signal over the full keys (docs/methods.md §5.5); KnapSpec's re-planned self-draft with
    Dustin verification is ``--method knapspec-dustin`` (:mod:`experiments.knapspec.self_spec`);
  - ``streaming``: StreamingLLM verification (4 sinks + the last ``K - 4`` positions);
  - ``snapkv``: SnapKV verification (static prompt selection of ``K`` positions after prefill +
    every generated token);
  - ``quest``: Quest verification (pages of 16, top ``K / 16`` pages per layer, query head and row;
    first 2 layers dense) -- its own verification forward inside the engine's rounds;
  - ``magicdec``: MagicDec, a draft reading a StreamingLLM view (4 sinks + ``K - 4``) of its KV with
    dense verification; with neither ``--draft`` nor ``--draft-skip`` the draft is the target
    itself with StreamingLLM attention.

  ClassicSD is ``--method sd``.
* ``dustin-profile`` -- SRH identification on calibration-split needle tasks + Algorithm 1 for one
  pair; saves a :class:`~jaxspec.dustin.search.DustinProfile` (provenance included).
* ``dustin-quality`` -- ARR, agreement with dense greedy output, perplexity under sparse vs dense
  attention, retrieval accuracy and tau for every method and budget (see :func:`cmd_dustin_quality`).

Modules: :mod:`~experiments.dustin_quality.options` (the ``generate`` methods and their options; importing
the package registers them), :mod:`~experiments.dustin_quality.tasks` (shared helpers),
:mod:`~experiments.dustin_quality.profile` (``dustin-profile``, ``dustin-m-bounds``),
:mod:`~experiments.dustin_quality.runner` (the per-item machinery) and
:mod:`~experiments.dustin_quality.quality` (``dustin-quality``, its tables and plots); this file registers the
sub-commands.
"""
from __future__ import annotations

from experiments.dustin_quality.options import SINKS, dustin_config_for, profile_config, sparse_policies
from experiments.dustin_quality.profile import cmd_dustin_m_bounds, cmd_dustin_profile
from experiments.dustin_quality.quality import cmd_dustin_quality, plot_m_rules
from experiments.dustin_quality.runner import ALL_METHODS, JITS, cached_jit, memory_summary, release_memory

__all__ = ["ALL_METHODS", "JITS", "SINKS", "cached_jit", "cmd_dustin_m_bounds", "cmd_dustin_profile",
           "cmd_dustin_quality", "dustin_config_for", "memory_summary", "plot_m_rules", "profile_config", "register",
           "release_memory", "sparse_policies"]


# ---------------------------------------------------------------------------- registration
def _pair_args(parser, budgets_default: str) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="target: registry name, .gguf, HF or orbax folder")
    parser.add_argument("--draft", default=None, help="separate draft model (same tokenizer)")
    parser.add_argument("--draft-skip", default=None, help="self-draft skipping sub-layers, e.g. 'mlp:10-12'")
    parser.add_argument("--budgets", default=budgets_default, help="KV budgets k (each one of 128..2048)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--source", default="austen", help="haystack: austen, wikipedia, or a .txt/.jsonl path")
    parser.add_argument("--task-seed", type=int, default=0, help="seed of the task suites (both splits)")
    parser.add_argument("--samples", type=int, default=1, help="tasks per (kind, length, depth) in each split")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                        help="float32 is faster than bfloat16 on CPU")


def register(subparsers) -> None:
    prof = subparsers.add_parser("dustin-profile", help="Dustin offline search: SRHs on calibration needle tasks + "
                                                        "Algorithm 1; saves the profile (--profile-file)")
    _pair_args(prof, "128,256,512,1024")
    prof.add_argument("--profile-file", default=None, metavar="FILE", help="where to save the profile JSON")
    prof.add_argument("--kinds", default="passkey,needle_qa", help="needle task kinds for SRH identification")
    prof.add_argument("--lengths", default="2048", help="calibration context lengths (tokens)")
    prof.add_argument("--depths", default="0.25,0.75")
    prof.add_argument("--max-new-tokens", type=int, default=16, help="greedy SD rounds' new tokens per calibration "
                                                                    "prompt (the ARR records)")
    prof.add_argument("--srh-max-new-tokens", type=int, default=None,
                      help="decode steps per needle test (default: longest answer + 8)")
    prof.add_argument("--recall-threshold", type=float, default=0.5)
    prof.add_argument("--srh-kv-groups", type=int, default=None, metavar="G",
                      help="GQA-aware SRHs: each layer's 4 heads from at most G KV groups (the best-scoring set "
                           "under that limit), so the scoring reads G KV heads' keys per SRH layer; default: "
                           "the best heads anywhere")
    prof.add_argument("--extend", default=None, metavar="FILE",
                      help="add --budgets to this existing profile: its SRHs, calibration rounds on --lengths "
                           "(e.g. longer prompts for a larger k), Algorithm 1 per new budget; its configs are kept")
    prof.add_argument("--recalibrate-m", action="store_true",
                      help="with --extend FILE: keep its SRH layers and recalibrate the split m of --budgets at each "
                           "of --lengths (step (c) of Algorithm 1 on calibration tasks of that length); the profile "
                           "then gives each run the m for its context length where asked (--dustin-m-per-length; "
                           "docs/methods.md §3.7)")
    prof.set_defaults(func=cmd_dustin_profile)

    bounds = subparsers.add_parser("dustin-m-bounds", help="how predictable the per-round best split m is: fixed m, "
                                                           "the oracle, the previous round's best m, the target "
                                                           "signal as the recall weights, the hindsight rule")
    _pair_args(bounds, "128,256,512,1024")
    bounds.add_argument("--dustin-profile", default=None, metavar="FILE", help="the pair's profile (dustin-profile)")
    bounds.add_argument("--kinds", default="passkey,needle_qa,kv_retrieval")
    bounds.add_argument("--lengths", default="2048", help="context lengths of the evaluation tasks (tokens)")
    bounds.add_argument("--depths", default="0.25,0.5,0.75")
    bounds.add_argument("--items", type=int, default=12, help="evaluation tasks decoded (the first N of the split)")
    bounds.add_argument("--max-new-tokens", type=int, default=48, help="greedy tokens per task (its rounds)")
    bounds.set_defaults(func=cmd_dustin_m_bounds)

    qual = subparsers.add_parser("dustin-quality", help="ARR, agreement with dense, perplexity, retrieval accuracy and "
                                                        "tau of Dustin-H/T/D and the sparse baselines per budget")
    _pair_args(qual, "128,256,512,1024")
    qual.add_argument("--dustin-profile", default=None, metavar="FILE", help="the pair's profile (dustin-profile)")
    qual.add_argument("--methods", default=",".join(ALL_METHODS))
    qual.add_argument("--items", default="2048:1,4096:1", help="LENGTH:COUNT evaluation tasks per context length")
    qual.add_argument("--kinds", default="passkey,needle_qa")
    qual.add_argument("--depths", default="0.25,0.5,0.75")
    qual.add_argument("--max-new-tokens", type=int, default=16)
    qual.add_argument("--ppl-tokens", type=int, default=40, help="teacher-forced haystack tokens for perplexity")
    qual.add_argument("--m-steps", type=int, default=1, metavar="N",
                      help="dustin-h-cov: steps of the coverage rule's candidate ladder on each side of the profiled m "
                           "(m -/+ i x 10 %% of k - s - w, i = 1..N; docs/methods.md §3.7)")
    qual.add_argument("--m-every", type=int, default=None, metavar="N",
                      help="dustin-h-cov-held: the coverage rule decides each row's m every N-th round only, the "
                           "rounds between select with that m by the fixed rule (docs/methods.md §3.7; default 3)")
    qual.add_argument("--m-every-schedule", default="cond", choices=["cond", "unrolled"],
                      help="dustin-h-cov-held: its rounds as one round body runs them, choosing deciding or holding "
                           "with a lax.cond on the device (cond, the default), or as the unrolled decoding loop runs "
                           "them, each round's kind compiled in (unrolled); docs/methods.md §3.7")
    qual.add_argument("--dustin-m-per-length", action="store_true",
                      help="Dustin-H's m (and the input-aware rules' centre) from the profile's m per context length "
                           "at each item's length (dustin-profile --recalibrate-m; docs/methods.md §3.7) instead of "
                           "its one profiled m")
    qual.add_argument("--plot", default=None, metavar="PNG", help="ARR vs k per method")
    qual.add_argument("--warm-workers", type=int, default=1, metavar="N",
                      help="before the first item, N processes (each a share of --methods, one item of that length) "
                           "fill the persistent compilation cache in parallel, and the run loads its programs from it "
                           "instead of compiling them one by one (a fresh H200 process compiled 434 programs in "
                           "739 s for its first 32k item); 1: no warm-up. Not part of the results' config")
    qual.set_defaults(func=cmd_dustin_quality)
