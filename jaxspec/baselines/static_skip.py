"""Static skip set baseline (Draft & Verify-style, docs/methods.md §4.4): a self-draft whose skipped
sub-layers are chosen once, offline, on calibration text, and kept for every prompt and every
context length.

Draft & Verify (Zhang et al. 2023) searches the skip set offline (Bayesian optimisation) and
drafts with a confidence-based early exit. Here the offline search is KnapSpec's own planner
(DP + grid search, or any planner, e.g. the coupled or CLaSp ones) run *once* on the last
``reference_tokens`` tokens of a calibration text (the rest is their prefix in the cache),
with ``t_attn`` at a fixed context ``context_n``; generation then uses that (mask, gamma)
without re-planning (same draft policy and early exit as KnapSpec; gamma 0 means plain
decoding throughout). The choice is saved as JSON (:class:`StaticSkipPlan`) and reloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import prefill
from jaxspec.knapspec.latency import LatencyModel, config_fields, effective_context
from jaxspec.knapspec.policy import KnapSpecConfig, KnapSpecPlanner, knapspec_generate
from jaxspec.models.cache import init_cache

FORMAT_VERSION = 1


@dataclasses.dataclass
class StaticSkipPlan:
    """A skip set chosen offline: ``mask [L, 2]`` (True = skip; column 0 Attention, column 1 MLP)
    and the draft length ``gamma`` (0 = plain decoding), with how it was chosen."""

    mask: np.ndarray
    gamma: int
    config: Dict[str, Any]  # the model config's fields (a plan is only valid for that model)
    source: Dict[str, Any]  # calibration: tokens, context_n, planner, plan summary

    def to_json(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, "mask": np.asarray(self.mask, bool).tolist(),
                           "gamma": int(self.gamma), "config": self.config, "source": self.source}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "StaticSkipPlan":
        data = json.loads(text)
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"static skip plan format {data.get('format_version')!r}; this jaxspec reads "
                             f"format {FORMAT_VERSION}")
        return cls(mask=np.asarray(data["mask"], bool), gamma=int(data["gamma"]), config=data["config"],
                   source=data["source"])

    def save(self, path) -> None:
        folder = os.path.dirname(os.fspath(path))
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(os.fspath(path), "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path) -> "StaticSkipPlan":
        with open(os.fspath(path)) as f:
            return cls.from_json(f.read())

    def matches(self, config: ModelConfig) -> bool:
        return self.config == config_fields(config)

    def summary(self) -> Dict[str, Any]:
        mask = np.asarray(self.mask, bool)
        return {"gamma": int(self.gamma), "skip_attn": np.nonzero(mask[:, 0])[0].tolist(),
                "skip_mlp": np.nonzero(mask[:, 1])[0].tolist(), "n_skip_attn": int(mask[:, 0].sum()),
                "n_skip_mlp": int(mask[:, 1].sum()), **{k: v for k, v in self.source.items() if k != "plan"}}


def calibrate_static_skip(target_params, config: ModelConfig, calibration_tokens: Sequence[int], *,
                          latency: Optional[LatencyModel] = None, knapspec=None, planner=None,
                          reference_tokens: int = 64, context_n: Optional[float] = None) -> StaticSkipPlan:
    """Choose the skip set once: prefill all but the last ``reference_tokens`` calibration tokens,
    run ``planner`` (default ``KnapSpecPlanner(latency, knapspec)``) on the last ones with
    ``t_attn`` at ``context_n`` (default: the effective context of the calibration cache)."""
    knapspec = KnapSpecConfig() if knapspec is None else knapspec
    if planner is None:
        if latency is None:
            raise ValueError("calibrate_static_skip needs a latency model or a planner")
        planner = KnapSpecPlanner(latency, knapspec)
    tokens = np.asarray(list(calibration_tokens), np.int32)
    reference_tokens = int(reference_tokens)
    if reference_tokens < 1 or len(tokens) < reference_tokens + 1:
        raise ValueError(f"need more than reference_tokens={reference_tokens} calibration tokens; got {len(tokens)}")
    bad = [int(t) for t in np.unique(tokens) if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"calibration token ids {bad[:5]} outside the vocabulary [0, {config.vocab_size})")
    prefix = tokens[:-reference_tokens]
    cache = init_cache(config, 1, len(tokens) + 1)
    cache, _ = prefill(target_params, config, prefix[None, :], np.asarray([len(prefix)]), cache)
    bucket = knapspec.token_bucket
    width = -(-reference_tokens // bucket) * bucket
    ref = np.zeros((1, width), np.int32)
    ref[0, :reference_tokens] = tokens[-reference_tokens:]
    token_mask = np.zeros((1, width), np.float32)
    token_mask[0, :reference_tokens] = 1.0
    n = float(context_n) if context_n is not None else effective_context(config, [len(tokens)], cache.capacity)
    plan, candidates, weights = planner.plan(target_params, config, cache, jnp.asarray(ref), jnp.asarray(token_mask),
                                             jnp.asarray([len(prefix)], jnp.int32), n)
    gamma = int(plan.gamma)
    if knapspec.honor_gamma:
        gamma = min(gamma, knapspec.gamma_max)
    else:
        gamma = knapspec.gamma_max
    source = {"calibration_tokens": int(len(tokens)), "reference_tokens": reference_tokens, "context_n": n,
              "planner": planner.name, "weights": list(weights),
              "candidates": len(candidates) if candidates is not None else 0, "plan": plan.summary()}
    return StaticSkipPlan(mask=np.asarray(plan.mask, bool), gamma=gamma, config=config_fields(config), source=source)


def load_or_calibrate(path, target_params, config: ModelConfig, calibration_tokens: Sequence[int], **kwargs):
    """Reuse the plan at ``path`` if it was made for this model config; otherwise calibrate and save
    it there. Returns ``(plan, loaded)``."""
    if path is not None and os.path.exists(os.fspath(path)):
        try:
            plan = StaticSkipPlan.load(path)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            plan = None
        if plan is not None and plan.matches(config):
            return plan, True
    plan = calibrate_static_skip(target_params, config, calibration_tokens, **kwargs)
    if path is not None:
        plan.save(path)
    return plan, False


def static_skip_generate(target_params, target_config: ModelConfig, prompts, *, plan: StaticSkipPlan, knapspec=None,
                         **kwargs):
    """Generate with a fixed self-draft (``plan.mask``, ``plan.gamma``; no re-planning): KnapSpec's
    driver and draft policy (early exit). ``kwargs`` as :func:`~jaxspec.knapspec.policy.knapspec_generate`."""
    knapspec = KnapSpecConfig() if knapspec is None else knapspec
    mask = np.asarray(plan.mask, bool)
    if mask.shape != (target_config.num_layers, 2):
        raise ValueError(f"static skip mask shape {mask.shape}; the model has {target_config.num_layers} layers")
    result = knapspec_generate(target_params, target_config, prompts, knapspec=knapspec,
                               initial_plan=(mask, int(plan.gamma)), replan=False, **kwargs)
    result.metrics["static_skip"] = plan.summary()
    return result


__all__ = ["StaticSkipPlan", "calibrate_static_skip", "load_or_calibrate", "static_skip_generate"]
