"""Static, hashable model configuration for the Llama family (Llama-2/3/3.x, Qwen2/2.5, SmolLM2).

A :class:`ModelConfig` is a frozen dataclass, so it can be a static argument of ``jax.jit``.
It is built from a Hugging Face ``config.json`` dict (:meth:`ModelConfig.from_hf_dict`), from
GGUF metadata (``jaxspec.models.loading``), or by hand for random-weight benchmark shapes
(:func:`preset`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Optional, Tuple

import numpy as np

#: Hugging Face ``model_type`` values that the one Llama-family code path serves.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

#: Names of the history-attention backends (the registry is ``jaxspec.models.attention.BACKENDS``,
#: which checks at import that its names are these; the config validates without importing it).
#: ``"auto"`` (the default) resolves per platform: ``"pallas-tpu"`` on a TPU, ``"xla"`` elsewhere.
ATTENTION_BACKENDS = ("xla", "pallas", "pallas-interpret", "pallas-tpu", "pallas-tpu-interpret", "auto")

#: RoPE scaling types we implement (``None`` / "default" means plain RoPE).
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one decoder-only Llama-family model.

    Attributes mirror the Hugging Face names where one exists. ``rope_scaling`` is a tuple of
    ``(key, value)`` pairs (not a dict) so that the config stays hashable.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[Tuple[Tuple[str, Any], ...]] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v projections
    max_position_embeddings: int = 8192
    model_type: str = "llama"
    name: str = "custom"
    dtype: str = "bfloat16"  # parameter and activation dtype; norms, softmax and logits are f32
    # history attention, a name of jaxspec.models.attention.BACKENDS: "xla" (jnp reference),
    # "pallas" (GPU kernels), "pallas-interpret" (the same kernels interpreted: slow, for tests),
    # "pallas-tpu" (Mosaic TPU kernels), "pallas-tpu-interpret" (those in TPU interpret mode on
    # CPU, for tests), "auto" (the default: resolved when the config is made, to "pallas-tpu" on a TPU
    # platform and "xla" elsewhere, so a config and every record of it name the backend that ran).
    # The parameter count is jaxspec.models.params.num_params(config) (derived from the layout).
    attention_backend: str = "auto"

    def __post_init__(self):
        if self.attention_backend == "auto":  # resolved now, so a config always names the backend it runs
            import jax

            object.__setattr__(self, "attention_backend", "pallas-tpu" if jax.default_backend() == "tpu" else "xla")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unknown architecture model_type={self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"dtype={self.dtype!r}; valid: 'bfloat16', 'float32', 'float16'")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}; valid: {ATTENTION_BACKENDS}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")

    # ------------------------------------------------------------------ derived values
    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rope_type(self) -> str:
        scaling = dict(self.rope_scaling or ())
        return scaling.get("rope_type", scaling.get("type", "default")) or "default"

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[self.dtype]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def inverse_frequencies(self) -> np.ndarray:
        """RoPE inverse frequencies ``[head_dim // 2]`` (float64), with llama3/linear scaling."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        scaling = dict(self.rope_scaling or ())
        kind = self.rope_type
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "llama3":
            factor = float(scaling["factor"])
            low = float(scaling.get("low_freq_factor", 1.0))
            high = float(scaling.get("high_freq_factor", 4.0))
            old_context = float(scaling["original_max_position_embeddings"])
            low_wavelen = old_context / low
            high_wavelen = old_context / high
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_context / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv_freq = np.where(medium, smoothed, scaled)
        return inv_freq

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], *, name: str = "custom", dtype: str = "bfloat16") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = hf.get("architectures")
            raise ValueError(
                f"unknown architecture model_type={model_type!r} (architectures={archs!r}); "
                f"jaxspec supports the Llama family: {SUPPORTED_MODEL_TYPES}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf.get('hidden_act')!r}; only 'silu' (SwiGLU) is supported")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported (no Llama/Qwen2 checkpoint uses it)")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_theta = float(rope_params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or rope_params or None
        if scaling:
            scaling = {k: v for k, v in dict(scaling).items() if k != "rope_theta"}
            if scaling.get("rope_type", scaling.get("type", "default")) in (None, "default"):
                scaling = None
        rope_scaling = tuple(sorted((k, _hashable(v)) for k, v in scaling.items())) if scaling else None
        if model_type == "qwen2" and hf.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        window = hf.get("sliding_window")
        if model_type == "mistral" and window is not None and window < int(hf.get("max_position_embeddings", 0)):
            raise ValueError(f"Mistral sliding_window={window} is not supported (jaxspec attends to the full context); "
                             "only configs with sliding_window null or >= max_position_embeddings load")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            model_type=model_type,
            name=name,
            dtype=dtype,
        )

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        data = dict(data)
        if data.get("rope_scaling"):
            data["rope_scaling"] = tuple(sorted((k, _hashable(v)) for k, v in data["rope_scaling"].items()))
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def _hashable(value):
    if isinstance(value, list):
        return tuple(value)
    return value


#: Random-weight benchmark shapes (the papers' models); real weights load from files.
PRESETS = {
    "qwen2.5-7b-shape": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                             num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6, attention_bias=True,
                             max_position_embeddings=32768, model_type="qwen2", rms_norm_eps=1e-6),
    "qwen2.5-0.5b-shape": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                               num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, attention_bias=True,
                               tie_word_embeddings=True, max_position_embeddings=32768, model_type="qwen2",
                               rms_norm_eps=1e-6),
    "qwen2.5-1.5b-shape": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                               num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, attention_bias=True,
                               tie_word_embeddings=True, max_position_embeddings=32768, model_type="qwen2",
                               rms_norm_eps=1e-6),
    "qwen2.5-72b-shape": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_layers=80,
                              num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=1e6, attention_bias=True,
                              max_position_embeddings=32768, model_type="qwen2", rms_norm_eps=1e-6),
    "smollm2-135m-shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                               num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5, tie_word_embeddings=True,
                               max_position_embeddings=8192, model_type="llama", rms_norm_eps=1e-5),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named random-weight shape, e.g. ``preset("qwen2.5-7b-shape", num_layers=2)``."""
    if name not in PRESETS:
        raise ValueError(f"unknown shape preset {name!r}; valid: {sorted(PRESETS)}")
    fields = dict(PRESETS[name], name=name)
    fields.update(overrides)
    return ModelConfig(**fields)
