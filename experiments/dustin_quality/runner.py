"""The machinery of ``dustin-quality``: every method of one item from the same prefilled caches, compiled once
per budget, timed and counted (:class:`QualityRunner`)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments.common import release_memory as common_release_memory, warm_compilation_cache
from experiments.dustin_quality.options import SINKS, profile_config


# ---------------------------------------------------------------------------- dustin-quality: the machinery
# Every method of one item starts from the same prefilled caches (copied), and runs the engine's own
# draft and commit phases (``speculative.draft_phase`` / ``commit_phase``, jitted as the engine does) around a verification forward
# whose index set is an *argument* (so Dustin-H/T/D, StreamingLLM, SnapKV and dense share one compiled
# verification per budget). The greedy tokens equal ``speculative_generate`` with the same policies
# (the CLI tests check that through ``generate``); only the compile count differs.

@dataclasses.dataclass(frozen=True)
class Method:
    """One verification method at one budget (``budget`` None: dense)."""

    name: str  # dense, dustin-h, dustin-t, dustin-d, streaming, snapkv, quest, magicdec
    budget: Optional[int] = None
    dustin: Any = None  # DustinConfig for dustin-*

    @property
    def key(self) -> str:
        return self.name if self.budget is None else f"{self.name}/k{self.budget}"


DUSTIN_MODES = {"dustin-h": "hybrid", "dustin-t": "target", "dustin-d": "draft"}
ALL_METHODS = ("dustin-h", "dustin-t", "dustin-d", "streaming", "quest", "snapkv", "magicdec")
#: Dustin-H with an input-aware m (docs/methods.md §3.7: max-mass, coverage, entropy) and with the per-round
#: ARR-maximising m (an oracle: it reads the full-KV verification's attention); not in the default --methods.
M_RULE_METHODS = {"dustin-h-ia": "max-mass", "dustin-h-cov": "coverage", "dustin-h-ent": "entropy",
                  "dustin-h-oracle": "oracle", "dustin-h-cov-held": "coverage"}
#: the coverage rule deciding every --m-every-th round only (DustinConfig.m_every; the rounds between select with
#: each row's held m by the fixed rule's per-row path)
HELD_METHOD, HELD_EVERY = "dustin-h-cov-held", 3
QUALITY_METHODS = ALL_METHODS[:1] + tuple(M_RULE_METHODS) + ALL_METHODS[1:]


def _jax():
    import jax
    import jax.numpy as jnp

    return jax, jnp


JITS: Dict[str, Any] = {}
#: seconds per phase of the current item (the dense record keeps them: where an item's time goes)
PHASES: Dict[str, float] = {}
EXTEND_CHUNK = 64  # tokens per prefill chunk when an item's question is appended to its cached prefix
#: XLA programs compiled (or loaded from the persistent cache) so far in this process, and their seconds
COMPILES = {"count": 0, "seconds": 0.0, "listening": False}


def count_compiles() -> Dict[str, float]:
    """A snapshot of :data:`COMPILES` (registers the listener on the first call)."""
    jax, _ = _jax()
    if not COMPILES["listening"]:
        def listener(name, seconds, **_):
            if name == "/jax/core/compile/backend_compile_duration":
                COMPILES["count"] += 1
                COMPILES["seconds"] += seconds

        jax.monitoring.register_event_duration_secs_listener(listener)
        COMPILES["listening"] = True
    return {"count": COMPILES["count"], "seconds": COMPILES["seconds"]}


def compiles_since(start: Dict[str, float]) -> Dict[str, float]:
    """Programs compiled since ``start`` (a :func:`count_compiles` snapshot) and their seconds."""
    now = count_compiles()
    return {"count": int(now["count"] - start["count"]), "seconds": round(now["seconds"] - start["seconds"], 3)}


def cached_jit(name, fn, **kwargs):
    jax, _ = _jax()
    if name not in JITS:
        JITS[name] = jax.jit(fn, **kwargs)
    return JITS[name]


def _verify_forward(params, rows, cache, indices, *, config, probe_heads):
    from jaxspec.models.llama import forward

    out = forward(params, rows, cache, config=config, verify_indices=indices, probe_heads=probe_heads)
    return out.logits, out.cache, (out.probes.queries if probe_heads else None)


def _reference_forward(params, rows, cache, *, config):
    """Dense verification probing every head: logits, cache, queries, history probabilities."""
    from jaxspec.dustin.arr import all_heads
    from jaxspec.models.llama import forward

    out = forward(params, rows, cache, config=config, probe_heads=all_heads(config))
    return out.logits, out.cache, out.probes.queries, out.probes.history_probs


def _quest_forward(params, rows, cache, *, config, budget):
    from jaxspec.baselines.quest import quest_verify_forward

    out = quest_verify_forward(params, rows, cache, config=config, budget=budget)
    return out.logits, out.cache


def _select_with(method_name, budget, dustin, query, target_keys, committed, snap, draft_scores_of, *, probe_t,
                 target_qpk, max_generated):
    """I_verify ``[B, k]`` of one method (traced); ``draft_scores_of(cfg, history)`` gives ``s_D``."""
    from jaxspec.baselines.streaming import streaming_indices
    from jaxspec.dustin.selection import select_for_config
    from jaxspec.dustin.signals import target_signal

    _, jnp = _jax()
    history = (committed - 1).astype(jnp.int32)
    if method_name == "streaming":
        return streaming_indices(history, sinks=SINKS, window=budget - SINKS)
    if method_name == "snapkv":
        from jaxspec.baselines.snapkv import SnapKVVerify

        return SnapKVVerify(budget=budget, max_generated=max_generated).verify_indices(snap, None, committed, None)
    cfg = dustin
    s_target = s_draft = None
    if cfg.uses_target_signal:
        rows = [probe_t.index((cfg.target_layer, h)) for h in cfg.target_heads]
        s_target = target_signal(query[:, rows], target_keys[cfg.target_layer], history, cfg.target_heads, target_qpk)
    if cfg.uses_draft_signal:
        s_draft = draft_scores_of(cfg, history)
    return select_for_config(cfg, s_draft, s_target, history)


def _draft_rows(cfg, probe_d):
    return [probe_d.index((layer, h)) for layer, hs in zip(cfg.draft_layers, cfg.draft_heads) for h in hs]


def _select(method_name, budget, dustin, query, target_keys, committed, draft_q, draft_keys, snap, *, probe_t,
            probe_d, target_qpk, draft_qpk, capacity, max_generated):
    """I_verify ``[B, k]`` of one method (traced; ``query [B, P_T, D]`` the target probes ``probe_t``
    of the last committed token, ``draft_q [B, P_D, gamma, D]`` the draft probes ``probe_d``)."""
    from jaxspec.dustin.signals import DraftSignals, draft_signal

    def draft_scores_of(cfg, history):
        layers = sorted({layer for layer, _ in probe_d})
        keys = tuple(draft_keys[layers.index(layer)] for layer in cfg.draft_layers)
        return draft_signal(DraftSignals(queries=draft_q[:, _draft_rows(cfg, probe_d)], keys=keys), history,
                            cfg.draft_heads, draft_qpk, capacity)

    return _select_with(method_name, budget, dustin, query, target_keys, committed, snap, draft_scores_of,
                        probe_t=probe_t, target_qpk=target_qpk, max_generated=max_generated)


def _take_last_query(old, queries, num_committed):
    _, jnp = _jax()
    row = jnp.maximum(num_committed - 1, 0)[:, None, None, None]
    query = jnp.take_along_axis(queries, row, axis=2)[:, :, 0]
    return jnp.where((num_committed > 0)[:, None, None], query, old)


def _quest_layer_arr(probs, queries, keys, lengths, *, budget, config):
    """Quest's ARR in one layer, one round: ``probs [B, H, T, S]`` (full-KV history probabilities),
    ``queries [B, H, T, D]``, ``keys [B, Hkv, S, D]``; mean over heads and rows of the mass on each
    (head, row)'s own Quest pages. One compile per budget serves every layer (same shapes)."""
    from jaxspec.baselines.quest import quest_mask

    _, jnp = _jax()
    batch, heads, steps, seq = probs.shape
    valid = (jnp.arange(seq)[None, :] < lengths[:, None])[:, None, None, :]
    p = jnp.where(valid, probs, 0.0)
    qg = queries.reshape(batch, config.num_kv_heads, config.queries_per_kv, steps, queries.shape[-1])
    mask = quest_mask(qg, keys, lengths, budget=budget).reshape(batch, heads, steps, seq)
    total = jnp.sum(p, axis=-1)
    kept = jnp.sum(jnp.where(mask, p, 0.0), axis=-1)
    return jnp.mean(kept / jnp.where(total > 0, total, 1.0), axis=(1, 2))


def _round_arr(weights, history_probs, queries, keys, lengths, quest_budgets, *, config):
    """ARR of Quest (per layer/head/row pages; the first 2 layers dense count 1) for each budget, one
    round: ``[len(quest_budgets), B]``."""
    _, jnp = _jax()
    heads = config.num_heads
    fn = cached_jit("quest_layer_arr", _quest_layer_arr, static_argnames=("budget", "config"))
    out = []
    for budget in quest_budgets:
        per_layer = [jnp.ones((history_probs.shape[0],), jnp.float32)] * min(2, config.num_layers)
        for layer in range(2, config.num_layers):
            part = slice(layer * heads, (layer + 1) * heads)
            per_layer.append(fn(history_probs[:, part], queries[:, part], keys[layer], lengths, budget=budget,
                                config=config))
        out.append(jnp.mean(jnp.stack(per_layer), axis=0))
    return jnp.stack(out)


class QualityRunner:
    """Runs every method on one prefilled item (see the module doc of ``dustin-quality``)."""

    def __init__(self, target, draft, mask, profile, gamma: int, max_new_tokens: int, stops):
        from jaxspec.decoding.sampling import SamplingConfig
        from jaxspec.decoding.speculative import EngineConfig

        self.target, self.draft, self.mask, self.profile = target, draft, mask, profile
        self.m_rule_stats: Dict[str, Dict[str, list]] = {}  # per method key, per round (docs/methods.md §3.7)
        self.m_held: Dict[str, Any] = {}  # dustin-h-cov-held: each method key's m per row since its last decision
        self.tcfg = target.config
        self.dcfg = draft.config if draft is not None else target.config
        self.engine = EngineConfig(gamma=gamma, sampling=SamplingConfig(), max_new_tokens=max_new_tokens,
                                   stop_tokens=tuple(stops))
        configs = [profile_config(profile, b, mode) for b in profile.configs for mode in ("hybrid", "draft")]
        t_layers = sorted({c.target_layer for c in configs})
        d_layers = sorted({layer for c in configs for layer in c.draft_layers})
        self.probe_t = tuple((layer, h) for layer in t_layers for h in range(self.tcfg.num_heads))
        self.probe_d = tuple((layer, h) for layer in d_layers for h in range(self.dcfg.num_heads))
        from jaxspec.dustin.policy import DustinDraft, DustinSelfDraft

        heads = tuple(tuple(range(self.dcfg.num_heads)) for _ in d_layers)
        if draft is not None:
            self.draft_policy = DustinDraft(config=self.dcfg, layers=tuple(d_layers), heads=heads)
        else:
            self.draft_policy = DustinSelfDraft(config=self.tcfg, layers=tuple(d_layers), heads=heads)

    # -- methods
    def methods(self, budgets, names, m_steps: int = 1, context: Optional[int] = None,
                m_every: int = HELD_EVERY, m_every_schedule: str = "cond") -> List[Method]:
        """The methods per budget; ``context``: Dustin-H's m (and the input-aware rules' centre) from the
        profile's per-length table at that many tokens (:meth:`DustinProfile.m_at`)."""
        out = []
        for budget in budgets:
            for name in names:
                dustin = profile_config(self.profile, budget, DUSTIN_MODES[name]) if name in DUSTIN_MODES else None
                if name in M_RULE_METHODS:
                    dustin = profile_config(self.profile, budget, "hybrid")
                    if name != "dustin-h-oracle":
                        dustin = dustin.replace(m_rule=M_RULE_METHODS[name])
                    if name == "dustin-h-cov" and m_steps != 1:
                        dustin = dustin.replace(m_steps=m_steps)
                    if name == HELD_METHOD:
                        dustin = dustin.replace(m_every=m_every, m_every_schedule=m_every_schedule)
                if context is not None and dustin is not None and dustin.mode == "hybrid":
                    dustin = dustin.replace(m=self.profile.m_at(budget, context))
                out.append(Method(name, budget, dustin))
        return out

    def magicdec_policy(self, budget):
        from jaxspec.baselines import MagicDecDraft, MagicDecSelfDraft

        if self.draft is not None:
            return MagicDecDraft(self.dcfg, sinks=SINKS, window=budget - SINKS)
        return MagicDecSelfDraft(self.tcfg, sinks=SINKS, window=budget - SINKS)

    # -- prefill
    def prefill(self, tokens: Sequence[int], capacity: int):
        """Target and draft caches holding ``tokens``; returns a dict (caches, first logits)."""
        from jaxspec.decoding.autoregressive import choose_prefill_chunk, prefill
        from jaxspec.models.cache import init_cache

        _, jnp = _jax()
        array = np.asarray([tokens], np.int32)
        lengths = np.asarray([len(tokens)], np.int32)
        # the chunk from the capacity, not the prompt length: one compiled chunk for every item of a length
        cache = init_cache(self.tcfg, 1, capacity)
        cache, logits = prefill(self.target.params, self.tcfg, array, lengths, cache,
                                chunk=choose_prefill_chunk(self.tcfg, 1, capacity, capacity))
        dcache = None
        if self.draft is not None:
            dcache = init_cache(self.dcfg, 1, capacity)
            dcache, _ = prefill(self.draft.params, self.dcfg, array, lengths, dcache,
                                chunk=choose_prefill_chunk(self.dcfg, 1, capacity, capacity))
        return {"cache": cache, "draft_cache": dcache, "logits": logits, "tokens": list(tokens)}

    def extend(self, base, tokens: Sequence[int]):
        """``base`` with ``tokens`` appended densely (a continued prefill)."""
        from jaxspec.decoding.autoregressive import prefill

        jax, jnp = _jax()
        array = np.asarray([tokens], np.int32)
        lengths = np.asarray([len(tokens)], np.int32)
        # one chunk size for every item (the chunk prefill picks grows with the token count: a new
        # compile whenever an item's question is longer)
        cache, logits = prefill(self.target.params, self.tcfg, array, lengths, jax.tree.map(jnp.copy, base["cache"]),
                                chunk=EXTEND_CHUNK)
        dcache = None
        if self.draft is not None:
            dcache, _ = prefill(self.draft.params, self.dcfg, array, lengths,
                                jax.tree.map(jnp.copy, base["draft_cache"]), chunk=EXTEND_CHUNK)
        return {"cache": cache, "draft_cache": dcache, "logits": logits, "tokens": base["tokens"] + list(tokens)}

    def _last_query(self, base, probe):
        from jaxspec.dustin.policy import last_prompt_query

        _, jnp = _jax()
        n = len(base["tokens"])
        if not probe:
            return jnp.zeros((1, 0, self.tcfg.head_dim), jnp.float32)
        return last_prompt_query(self.target.params, jnp.asarray([[base["tokens"][-1]]], jnp.int32),
                                  base["cache"].with_lengths(jnp.asarray([n - 1], jnp.int32)), config=self.tcfg,
                                  probe_heads=probe)

    def snap_state(self, base, budget):
        from jaxspec.baselines import SnapKVVerify

        _, jnp = _jax()
        policy = SnapKVVerify(self.tcfg, budget=budget, max_generated=self.engine.max_new_tokens + 64)
        n = len(base["tokens"])
        tokens = np.asarray([base["tokens"]], np.int32)
        if n >= policy.window:  # right-padded to the cache capacity: one compile for every item of a length
            tokens = np.pad(tokens, ((0, 0), (0, base["cache"].capacity - n)))
        return policy.prepare(self.target.params, self.tcfg, tokens, np.asarray([n], np.int32), cache=base["cache"])

    # -- decoding
    def decode(self, base, method: Method, *, reference: bool = False, arr_methods: Sequence[Method] = ()):
        """Greedy speculative decoding of one method from ``base`` (a full-prompt prefill). Returns
        (tokens, metrics, arr) -- ``arr``: mean ARR per ``arr_methods`` key on this (dense) trajectory
        when ``reference``."""
        from jaxspec.decoding import speculative
        from jaxspec.dustin.arr import all_heads, recall_of_indices, recall_weights

        jax, jnp = _jax()
        engine, tcfg = self.engine, self.tcfg
        copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
        tokens = base["tokens"]
        first = jnp.argmax(base["logits"], axis=-1).astype(jnp.int32)
        draft_policy = self.magicdec_policy(method.budget) if method.name == "magicdec" else self.draft_policy
        if self.draft is not None:
            draft_state = copy(base["draft_cache"])
        elif method.name == "magicdec":
            draft_state = {}  # StreamingLLM self-draft without skipping (docs/methods.md §6: the SmolLM2 self-draft)
        else:
            draft_state = {"skip_mask": jnp.asarray(self.mask, bool)}
        probe_t = all_heads(tcfg) if reference else (self.probe_t if method.name.startswith("dustin") else ())
        query = self._last_query(base, probe_t)
        state = speculative.loop_state_from_caches(copy(base["cache"]), draft_state, first,
                                                   jnp.asarray([tokens[-1]], jnp.int32), engine, verify_state=query)
        stop = set(engine.stop_tokens)
        if int(first[0]) in stop:
            state = state._replace(done=jnp.ones((1,), bool))
        snaps = {}
        for m in ([method] if method.name == "snapkv" else []) + [m for m in arr_methods if m.name == "snapkv"]:
            snaps[m.budget] = self.snap_state(base, m.budget)
        probe_d = self.probe_d if draft_policy is self.draft_policy else ()
        select_static = dict(probe_t=probe_t, probe_d=probe_d, target_qpk=tcfg.queries_per_kv,
                             draft_qpk=self.dcfg.queries_per_kv, capacity=state.target_cache.capacity,
                             max_generated=self.engine.max_new_tokens + 64)
        arr_sums: Dict[str, float] = {m.key: 0.0 for m in arr_methods}
        arr_rounds = 0
        quest_budgets = tuple(sorted({m.budget for m in arr_methods if m.name == "quest"}))
        while int(state.round) < engine.max_new_tokens and not bool(jnp.all(state.done)):
            proposal, key = cached_jit("draft_phase", speculative.draft_phase,
                                       static_argnames=("target_config", "draft_policy", "engine"),
                                       donate_argnames=("draft_state", "target_cache"))(self.target.params, self.draft.params if self.draft else
                                                   self.target.params, state.draft_state, state.target_cache,
                                                   state.pending, state.previous, state.committed, state.key,
                                                   target_config=tcfg, draft_policy=draft_policy, engine=engine)
            signals = proposal.signals
            draft_q = signals.queries if signals is not None else None
            draft_keys = signals.keys if signals is not None else ()
            history = state.committed - 1
            cache = proposal.target_cache.with_lengths(history)
            rows = jnp.concatenate([state.pending[:, None], proposal.tokens], axis=1)
            if reference:
                logits, new_cache, queries, hprobs = cached_jit(
                    "reference", _reference_forward, static_argnames=("config",))(
                    self.target.params, rows, cache, config=tcfg)
                weights = recall_weights(hprobs, history)
                for m in arr_methods:
                    if m.name in ("quest", "magicdec"):
                        continue
                    if m.name in M_RULE_METHODS:
                        arr_sums[m.key] += self.m_rule_round(m, weights, state.verify_state, cache.keys,
                                                             state.committed, draft_q, draft_keys, select_static,
                                                             round_index=arr_rounds)
                        continue
                    t_select = time.perf_counter()
                    indices = cached_jit(f"select/{m.key}", _select, static_argnames=(
                        "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk",
                        "capacity", "max_generated"))(
                        m.name, m.budget, m.dustin, state.verify_state, cache.keys, state.committed, draft_q,
                        draft_keys, snaps.get(m.budget), **select_static)
                    indices.block_until_ready()
                    if m.name == "dustin-h":
                        self.m_rule_stats.setdefault(m.key, {}).setdefault("select_s", []).append(
                            time.perf_counter() - t_select)
                    arr_sums[m.key] += float(recall_of_indices(weights, indices)[0])
                if quest_budgets:
                    quest = _round_arr(weights, hprobs, queries, cache.keys, history, quest_budgets, config=tcfg)
                    for i, budget in enumerate(quest_budgets):
                        arr_sums[f"quest/k{budget}"] += float(quest[i, 0])
                arr_rounds += 1
            elif method.name == "quest":
                logits, new_cache = cached_jit(f"quest/{method.budget}", _quest_forward,
                                         static_argnames=("config", "budget"))(
                    self.target.params, rows, cache, config=tcfg, budget=method.budget)
                queries = None
            else:
                indices = None
                if method.name == "dustin-h-oracle":
                    indices = self.oracle_indices(method, rows, cache, state.verify_state, state.committed, draft_q,
                                                  draft_keys, select_static)
                elif method.name not in ("dense", "magicdec"):
                    indices = cached_jit(f"select/{method.key}", _select, static_argnames=(
                        "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk",
                        "capacity", "max_generated"))(
                        method.name, method.budget, method.dustin, state.verify_state, cache.keys, state.committed,
                        draft_q, draft_keys, snaps.get(method.budget), **select_static)
                logits, new_cache, queries = cached_jit("verify", _verify_forward,
                                                  static_argnames=("config", "probe_heads"))(
                    self.target.params, rows, cache, indices, config=tcfg, probe_heads=probe_t)
            before = state
            state = cached_jit("commit_phase", speculative.commit_phase, static_argnames=("engine",),
                               donate_argnames=("proposal", "target_cache"))(state._replace(target_cache=None, draft_state=None),
                                            proposal._replace(target_cache=None), logits, new_cache, key,
                                            engine=engine)
            if probe_t:
                num = state.committed - before.committed
                state = state._replace(verify_state=cached_jit("last_query", _take_last_query)(
                    before.verify_state, queries, num))
        out = np.asarray(state.out)[0, :engine.max_new_tokens]
        generated = [int(t) for t in out if t >= 0]
        metrics = speculative.summarize(state, engine)
        arr = {k: v / max(arr_rounds, 1) for k, v in arr_sums.items()} if reference else {}
        return generated, metrics, arr

    # -- input-aware and oracle m (docs/methods.md §3.7)
    def _signals(self, method, query, target_keys, committed, draft_q, draft_keys, select_static):
        static = {k: v for k, v in select_static.items() if k != "max_generated"}
        return cached_jit(f"signals/{method.key}", _dustin_signals, static_argnames=(
            "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk", "capacity"))(
            method.dustin, query, target_keys, committed, draft_q, draft_keys, **static)

    def _arr_curve(self, method, weights, s_draft, s_target, committed):
        from jaxspec.dustin.search import sweep_m

        cfg = method.dustin
        return sweep_m(np.asarray(weights), np.asarray(s_draft), np.asarray(s_target), np.asarray(committed - 1),
                       k=cfg.budget, sinks=cfg.sinks, window=cfg.window_size)

    def m_rule_round(self, method, weights, query, target_keys, committed, draft_q, draft_keys, select_static,
                     round_index: int = 0) -> float:
        """One reference round of ``dustin-h-ia`` / ``dustin-h-oracle``: its ARR; records the chosen m
        (and, for the input-aware rule, the selection time beside the fixed rule's on the same signals).
        ``round_index``: the round within the item; ``dustin-h-cov-held`` decides at multiples of its
        ``m_every`` and selects with the m it chose in the rounds between."""
        from jaxspec.dustin.arr import recall_of_indices
        from jaxspec.dustin.selection import (entropy_rule_args, max_mass_split, select_entropy_gated,
                                              select_held, select_input_aware, select_max_mass,
                                              select_scheduled, select_verify_indices)

        cfg = method.dustin
        stats = self.m_rule_stats.setdefault(method.key, {})
        both = cfg.input_aware if method.name != "dustin-h-oracle" else bool(cfg.draft_layers and cfg.target_heads)
        if not both:  # no split to choose (no draft layer, or the rule has no choice at this m)
            stats.setdefault("m", []).append(cfg.effective_m)
            indices = cached_jit(f"select/{method.key}", _select, static_argnames=(
                "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk", "capacity",
                "max_generated"))("dustin-h", cfg.budget, cfg.replace(m_rule="fixed"), query, target_keys, committed,
                                  draft_q, draft_keys, None, **select_static)
            return float(recall_of_indices(weights, indices)[0])
        s_draft, s_target = self._signals(method, query, target_keys, committed, draft_q, draft_keys, select_static)
        history = committed - 1
        if method.name == "dustin-h-oracle":
            curve = self._arr_curve(method, weights, s_draft, s_target, committed)
            best = int(np.argmax(curve))
            stats.setdefault("m", []).append(best)
            stats.setdefault("fixed_arr_from_curve", []).append(float(curve[cfg.effective_m]))
            return float(curve[best])
        # selection only (signals given), best of 3 calls each: fixed m vs this rule
        shape = dict(k=cfg.budget, sinks=cfg.sinks, window=cfg.window_size)
        if cfg.m_rule == "max-mass":
            rule = lambda: select_max_mass(s_draft, s_target, history, balance=cfg.m_balance, **shape)  # noqa: E731
        elif cfg.m_rule == "entropy":
            rule = lambda: select_entropy_gated(s_draft, s_target, history, **entropy_rule_args(cfg))  # noqa: E731
        else:
            rule = lambda: select_input_aware(s_draft, s_target, history, candidates=cfg.m_candidates, **shape)  # noqa: E731
        if cfg.m_every > 1:  # the held rule as the verifier runs it: decides at multiples of m_every, else holds
            _, jnp = _jax()
            held = self.m_held.get(method.key, jnp.full(history.shape, cfg.effective_m, jnp.int32))
            decides = round_index % cfg.m_every == 0
            if cfg.m_every_schedule == "unrolled":  # the unrolled loop's round: its kind compiled in
                rule = lambda: select_scheduled(cfg, s_draft, s_target, history, held, decide=decides)  # noqa: E731
            else:  # one round body, the kind a traced predicate (lax.cond)
                decide = jnp.asarray(decides)
                rule = lambda: select_held(cfg, s_draft, s_target, history, held, decide)  # noqa: E731
        timings = {}
        for name, call in (("fixed", lambda: select_verify_indices(s_draft, s_target, history, m=cfg.effective_m,
                                                                   **shape)),
                           ("input-aware", rule)):
            jax_out = call()  # compiled on the first round
            jax_out = jax_out[0] if isinstance(jax_out, tuple) else jax_out
            jax_out.block_until_ready()
            best_t = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                out = call()
                (out[0] if isinstance(out, tuple) else out).block_until_ready()
                best_t = min(best_t, time.perf_counter() - t0)
            timings[name] = best_t
        stats.setdefault("selection_s_fixed", []).append(timings["fixed"])
        stats.setdefault("selection_s_input_aware", []).append(timings["input-aware"])
        if cfg.m_rule == "max-mass":
            indices = rule()
            chosen = max_mass_split(s_draft, s_target, history, indices, sinks=cfg.sinks, window=cfg.window_size,
                                    balance=cfg.m_balance)
        else:
            indices, chosen = rule()
            if cfg.m_every > 1:
                self.m_held[method.key] = chosen
        stats.setdefault("m", []).append(int(chosen[0]))
        return float(recall_of_indices(weights, indices)[0])

    def oracle_indices(self, method, rows, cache, query, committed, draft_q, draft_keys, select_static):
        """``I_verify`` with the m maximising this round's ARR, read from a full-KV forward of the
        round (an oracle: it costs a dense verification)."""
        from jaxspec.dustin.arr import recall_weights
        from jaxspec.dustin.selection import select_verify_indices_rows

        _, jnp = _jax()
        cfg = method.dustin
        if not (cfg.draft_layers and cfg.target_heads):  # one signal only: the fixed selection
            return cached_jit(f"select/{method.key}", _select, static_argnames=(
                "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk", "capacity",
                "max_generated"))("dustin-h", cfg.budget, cfg, query, cache.keys, committed, draft_q, draft_keys,
                                  None, **select_static)
        _, _, _, hprobs = cached_jit("reference", _reference_forward, static_argnames=("config",))(
            self.target.params, rows, cache, config=self.tcfg)
        weights = recall_weights(hprobs, committed - 1)
        s_draft, s_target = self._signals(method, query, cache.keys, committed, draft_q, draft_keys, select_static)
        best = int(np.argmax(self._arr_curve(method, weights, s_draft, s_target, committed)))
        return select_verify_indices_rows(s_draft, s_target, committed - 1, jnp.asarray([best], jnp.int32),
                                          k=cfg.budget, sinks=cfg.sinks, window=cfg.window_size)

    # -- teacher-forced perplexity
    def draft_chunk_scores(self, base, text: Sequence[int]):
        """Per chunk of ``gamma + 1`` text tokens, the draft's per-(layer, head) lookahead scores
        ``[P_D, S]`` (rows ``pending, x_1 .. x_{gamma-1}``; history = the tokens before the chunk)."""
        from jaxspec.dustin.signals import head_scores
        from jaxspec.models.llama import forward

        jax, jnp = _jax()
        gamma = self.engine.gamma
        if not self.probe_d:
            return [None] * (len(text) // (gamma + 1))
        d_layers = sorted({layer for layer, _ in self.probe_d})

        def fn(params, rows, cache, skip_mask, *, config, probe):
            out = forward(params, rows, cache, config=config, probe_heads=probe, skip_mask=skip_mask)
            q = out.probes.queries[:, :, :gamma]
            per_head = []
            for index, (layer, head) in enumerate(probe):
                per_head.append(head_scores(q[:, index:index + 1], out.cache.keys[layer], cache.lengths, (head,),
                                            config.queries_per_kv)[0])
            return jnp.stack(per_head), out.cache

        scorer = cached_jit("draft_scores", fn, static_argnames=("config", "probe"))
        cache = jax.tree.map(jnp.copy, base["draft_cache"] if self.draft is not None else base["cache"])
        params = self.draft.params if self.draft is not None else self.target.params
        mask = None if self.draft is not None else jnp.asarray(self.mask, bool)
        scores = []
        n = len(base["tokens"])
        for start in range(0, len(text) - gamma, gamma + 1):
            rows = jnp.asarray([text[start:start + gamma + 1]], jnp.int32)
            s, new_cache = scorer(params, rows, cache.with_lengths(jnp.asarray([n + start], jnp.int32)), mask,
                                  config=self.dcfg, probe=self.probe_d)
            scores.append(s)
            if self.draft is not None:
                cache = new_cache
            else:  # a self-draft reads the (dense) target cache: write the text's dense target KV there
                cache = cached_jit("dense_write", _verify_forward, static_argnames=("config", "probe_heads"))(
                    self.target.params, rows, cache.with_lengths(jnp.asarray([n + start], jnp.int32)), None,
                    config=self.tcfg, probe_heads=())[1]
        del d_layers
        return scores

    def perplexity(self, base, text: Sequence[int], method: Method, draft_scores) -> Dict[str, float]:
        """Teacher-forced NLL of ``text`` after ``base``: chunks of ``gamma + 1`` tokens verified like a
        round (every row attends to ``I_verify`` of the method + the chunk, causally); the KV the
        chunk writes is computed under the method's attention (as in decoding)."""
        jax, jnp = _jax()
        gamma = self.engine.gamma
        tcfg = self.tcfg
        cache = jax.tree.map(jnp.copy, base["cache"])
        n = len(base["tokens"])
        probe_t = self.probe_t if method.name.startswith("dustin") else ()
        query = self._last_query(base, probe_t)
        snap = self.snap_state(base, method.budget) if method.name == "snapkv" else None
        nll, count = 0.0, 0
        select_static = dict(probe_t=probe_t, probe_d=self.probe_d, target_qpk=tcfg.queries_per_kv,
                             draft_qpk=self.dcfg.queries_per_kv, capacity=cache.capacity,
                             max_generated=self.engine.max_new_tokens + 64)
        for chunk, start in enumerate(range(0, len(text) - gamma, gamma + 1)):
            rows = jnp.asarray([text[start:start + gamma + 1]], jnp.int32)
            committed = jnp.asarray([n + start + 1], jnp.int32)  # history = n + start positions
            cache = cache.with_lengths(committed - 1)
            queries = None
            if method.name == "quest":
                logits, cache = cached_jit(f"quest/{method.budget}", _quest_forward, static_argnames=("config", "budget"))(
                    self.target.params, rows, cache, config=tcfg, budget=method.budget)
            else:
                indices = None
                if method.name not in ("dense", "magicdec"):
                    scores = draft_scores[chunk]
                    indices = cached_jit(f"ppl-select/{method.key}", _select_from_scores, static_argnames=(
                        "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk",
                        "capacity", "max_generated"))(
                        method.name, method.budget, method.dustin, query, cache.keys, committed, scores, snap,
                        **select_static)
                logits, cache, queries = cached_jit("verify", _verify_forward, static_argnames=("config", "probe_heads"))(
                    self.target.params, rows, cache, indices, config=tcfg, probe_heads=probe_t)
            targets = text[start + 1:start + gamma + 2]
            logp = jax.nn.log_softmax(logits[0, :len(targets)], axis=-1)
            nll -= float(jnp.sum(logp[jnp.arange(len(targets)), jnp.asarray(targets)]))
            count += len(targets)
            if probe_t:
                query = queries[:, :, -1]
        return {"nll": nll / count, "ppl": float(np.exp(nll / count)), "tokens": count}


def _dustin_signals(dustin, query, target_keys, committed, draft_q, draft_keys, *, probe_t, probe_d, target_qpk,
                    draft_qpk, capacity):
    """``(s_D, s_T) [B, S]`` of a hybrid Dustin config (traced; the inputs of :func:`_select`)."""
    from jaxspec.dustin.signals import DraftSignals, draft_signal, target_signal

    _, jnp = _jax()
    cfg = dustin
    history = (committed - 1).astype(jnp.int32)
    rows = [probe_t.index((cfg.target_layer, h)) for h in cfg.target_heads]
    s_target = target_signal(query[:, rows], target_keys[cfg.target_layer], history, cfg.target_heads, target_qpk)
    layers = sorted({layer for layer, _ in probe_d})
    keys = tuple(draft_keys[layers.index(layer)] for layer in cfg.draft_layers)
    s_draft = draft_signal(DraftSignals(queries=draft_q[:, _draft_rows(cfg, probe_d)], keys=keys), history,
                           cfg.draft_heads, draft_qpk, capacity)
    return s_draft, s_target


def _select_from_scores(method_name, budget, dustin, query, target_keys, committed, draft_scores, snap, *, probe_t,
                        probe_d, target_qpk, draft_qpk, capacity, max_generated):
    """``_select`` with the draft signal given as per-(layer, head) scores ``[P_D, S]`` (perplexity)."""
    from jaxspec.dustin.signals import fit_width

    _, jnp = _jax()

    def draft_scores_of(cfg, history):
        rows = jnp.asarray(_draft_rows(cfg, probe_d))
        return fit_width(jnp.sum(draft_scores[rows], axis=0)[None], capacity)

    return _select_with(method_name, budget, dustin, query, target_keys, committed, snap, draft_scores_of,
                        probe_t=probe_t, target_qpk=target_qpk, max_generated=max_generated)


def match_tokens(tokens, reference) -> Tuple[float, Optional[int]]:
    """(token match rate over the reference's positions, first divergence index or None)."""
    total = max(len(reference), 1)
    same = sum(1 for a, b in zip(tokens, reference) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if first is None and len(tokens) != len(reference):
        first = min(len(tokens), len(reference))
    return same / total, first


def fmt_value(value) -> str:
    """``None`` (e.g. tau of a run whose first token was a stop token: no rounds) as ``-``."""
    return "-" if value is None else f"{value:.2f}"


def memory_summary() -> str:
    """Resident memory of this process and the live JAX arrays (progress lines; memory diagnostics)."""
    jax, _ = _jax()
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        rss = f"rss {int(fields['VmRSS'].split()[0]) / 2**20:.2f} GB (peak {int(fields['VmHWM'].split()[0]) / 2**20:.2f})"
    except (OSError, KeyError, ValueError):
        rss = "rss ?"
    arrays = jax.live_arrays()
    return f"{rss}, {len(arrays)} live arrays {sum(a.nbytes for a in arrays) / 2**30:.2f} GB"


def release_memory(clear_compiled: bool = False) -> None:
    """:func:`experiments.common.release_memory` with this module's jit table, timed into ``PHASES``."""
    t0 = time.perf_counter()
    common_release_memory(clear_compiled, jit_tables=(JITS,))
    PHASES["release_memory"] = PHASES.get("release_memory", 0.0) + time.perf_counter() - t0


def warm_cache_for_quality(args, names: Sequence[str], workers: int, length: int) -> List[Dict[str, Any]]:
    """Compile this run's programs in ``workers`` processes at once (:func:`warm_compilation_cache`):
    worker i runs one item of ``length`` with every ``workers``-th method from the i-th on, all budgets
    of a method in one worker (the ARR of Quest's budgets is one program); the programs every method
    needs (prefill, perplexity, dense decoding) are built in each."""
    groups = [",".join(names[i::workers]) for i in range(workers)]
    overrides = [{"--methods": group, "--items": f"{length}:1", "--out": f"{{tmp}}/worker{i}.json", "--plot": None,
                  "--warm-workers": None} for i, group in enumerate(groups)]
    return warm_compilation_cache("dustin-quality", args.argv, overrides)


def select_items(evaluation, per_length: Dict[int, int], seed: int):
    import random

    items = []
    for length, count in sorted(per_length.items()):
        pool = [t for t in evaluation if t.context_tokens == length]
        random.Random(seed * 1000 + length).shuffle(pool)
        items.extend(pool[:count])
    return items
