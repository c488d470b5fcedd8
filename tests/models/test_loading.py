"""Loading weights: Hugging Face folders, orbax checkpoints, GGUF files, and every error path.

GGUF mapping is tested without the 98 MB SmolLM2 file: tiny llama/qwen2 GGUF files are
written with ``gguf.GGUFWriter`` from the tiny transformers models, applying llama.cpp's Q/K
row permutation for the llama architecture the way ``convert_hf_to_gguf.py`` does, and the
logits of ``load_gguf`` must reproduce transformers'.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import registry
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit
from jaxspec.models.loading import (CheckpointError, LoadedModel, load_checkpoint, load_gguf, load_hf_folder,
                                    load_model, load_tokenizer, save_checkpoint)

from tests.conftest import TINY_VOCAB, max_rel_error

TOKENS = np.random.RandomState(7).randint(0, TINY_VOCAB, size=(2, 12)).astype(np.int32)


def _copy_folder(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    shutil.copytree(source, target)
    return target


def _edit_config(folder: pathlib.Path, **changes) -> pathlib.Path:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return path


def _state_dict(hf_model) -> dict:
    return {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}


def _logits(params, config, tokens=TOKENS):
    cache = init_cache(config, tokens.shape[0], 16)
    return np.asarray(forward_jit(params, jnp.asarray(tokens), cache, config=config).logits)


# ---------------------------------------------------------------------------- Hugging Face folder
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_folder_round_trip(tiny_models, family):
    tiny = tiny_models[family]
    state = _state_dict(tiny.hf_model)
    loaded = load_hf_folder(tiny.folder, dtype="float32", with_tokenizer=False)
    params = loaded.params
    np.testing.assert_array_equal(np.asarray(params.embed), state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(params.final_norm), state["model.norm.weight"])
    if loaded.config.tie_word_embeddings:
        assert params.lm_head is None
    else:
        np.testing.assert_array_equal(np.asarray(params.lm_head), state["lm_head.weight"].T)
    names = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
             "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
             "w_down": "mlp.down_proj.weight"}
    for i, layer in enumerate(params.layers):
        for ours, theirs in names.items():
            np.testing.assert_array_equal(np.asarray(getattr(layer, ours)), state[f"model.layers.{i}.{theirs}"].T)
        np.testing.assert_array_equal(np.asarray(layer.attn_norm), state[f"model.layers.{i}.input_layernorm.weight"])
        np.testing.assert_array_equal(np.asarray(layer.mlp_norm),
                                      state[f"model.layers.{i}.post_attention_layernorm.weight"])
        if family == "qwen2":
            for bias in ("q", "k", "v"):
                np.testing.assert_array_equal(np.asarray(getattr(layer, f"b{bias}")),
                                              state[f"model.layers.{i}.self_attn.{bias}_proj.bias"])
                assert np.any(np.asarray(getattr(layer, f"b{bias}")) != 0)
        else:
            assert layer.bq is None and layer.bk is None and layer.bv is None
    # config mapping
    hf = tiny.hf_model.config
    assert loaded.config.num_layers == hf.num_hidden_layers
    assert loaded.config.num_kv_heads == hf.num_key_value_heads
    assert loaded.config.attention_bias == (family == "qwen2")
    # default dtype: bfloat16 weights, float32 norms; and load_model picks the HF route
    default = load_model(str(tiny.folder), with_tokenizer=False)
    assert default.config.dtype == "bfloat16" and default.info["format"] == "hf"
    assert default.params.layers[0].wq.dtype == jnp.bfloat16
    assert default.params.layers[0].attn_norm.dtype == jnp.float32
    assert default.params.final_norm.dtype == jnp.float32


@pytest.mark.parametrize("family", ["qwen2", "llama31"])  # biases; llama3 rope_scaling through JSON
def test_orbax_round_trip(tiny_models, tmp_path, family):
    tiny = tiny_models[family]
    original = LoadedModel(tiny.config, tiny.params, None, str(tiny.folder), {"format": "hf"})
    folder = save_checkpoint(tmp_path / "ckpt", original)
    restored = load_checkpoint(folder, with_tokenizer=False)
    assert restored.config == tiny.config
    assert restored.info["source"] == str(tiny.folder)  # provenance of the original load is kept
    flat_original = jax.tree_util.tree_leaves_with_path(tiny.params)
    flat_restored = dict(jax.tree_util.tree_leaves_with_path(restored.params))
    assert len(flat_original) == len(flat_restored)
    for path, value in flat_original:
        np.testing.assert_array_equal(np.asarray(flat_restored[path]), np.asarray(value), err_msg=str(path))
        assert flat_restored[path].dtype == value.dtype
    # load_model recognises the folder; a dtype override casts (norms stay float32)
    as_bf16 = load_model(str(folder), dtype="bfloat16", with_tokenizer=False)
    assert as_bf16.config.dtype == "bfloat16"
    assert as_bf16.params.layers[1].wv.dtype == jnp.bfloat16
    assert as_bf16.params.layers[1].mlp_norm.dtype == jnp.float32
    # saving again over an existing checkpoint replaces it
    save_checkpoint(folder, original)
    assert load_checkpoint(folder, with_tokenizer=False).config == tiny.config
    # saved without a tokenizer: asking for one is a clear error, not a None that fails later
    with pytest.raises(CheckpointError, match="saved without a tokenizer.*with_tokenizer=False"):
        load_checkpoint(folder)


def test_fused_params_are_saved_in_the_separate_layout(tiny_qwen2, tmp_path):
    """docs/methods.md §2, fused projections: a checkpoint always holds the separate layout, so fused params saved
    and loaded again give back exactly the separate params."""
    from jaxspec.models.params import fuse_projections, is_fused

    fused = LoadedModel(tiny_qwen2.config, fuse_projections(tiny_qwen2.params), None, "fused", {"format": "hf"})
    restored = load_checkpoint(save_checkpoint(tmp_path / "fused", fused), with_tokenizer=False)
    assert not is_fused(restored.params) and is_fused(fused.params)
    for (path, value), (_, back) in zip(jax.tree_util.tree_leaves_with_path(tiny_qwen2.params),
                                        jax.tree_util.tree_leaves_with_path(restored.params)):
        np.testing.assert_array_equal(np.asarray(back), np.asarray(value), err_msg=str(path))


def test_save_checkpoint_does_not_delete_an_unrelated_folder(tiny_qwen2, tmp_path):
    """Saving into an existing folder that is not a jaxspec checkpoint must refuse, not wipe it.

    (Library bug at the time of writing: ``save_checkpoint`` runs ``shutil.rmtree(folder)`` on any
    existing folder, so ``save_checkpoint("~/work", model)`` deletes the user's files.)
    """
    folder = tmp_path / "my_project"
    folder.mkdir()
    (folder / "notes.txt").write_text("precious")
    original = LoadedModel(tiny_qwen2.config, tiny_qwen2.params, None, "x", {})
    with pytest.raises((CheckpointError, FileExistsError)) as info:
        save_checkpoint(folder, original)
    assert str(folder) in str(info.value)
    assert (folder / "notes.txt").read_text() == "precious"


def test_orbax_corrupt_marker_raises(tiny_qwen2, tmp_path):
    original = LoadedModel(tiny_qwen2.config, tiny_qwen2.params, None, "x", {})
    folder = save_checkpoint(tmp_path / "ckpt", original)
    (folder / "jaxspec_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="jaxspec_config.json"):
        load_checkpoint(folder, with_tokenizer=False)


# ---------------------------------------------------------------------------- HF error paths
def test_hf_folder_without_tokenizer_files_is_a_clear_error(tiny_llama):
    """The folder has weights but no tokenizer: say so at load time (the CLIs need a tokenizer)."""
    assert not any((tiny_llama.folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    for load in (lambda: load_hf_folder(tiny_llama.folder), lambda: load_model(str(tiny_llama.folder))):
        with pytest.raises(CheckpointError) as info:
            load()
        message = str(info.value)
        assert str(tiny_llama.folder) in message and "tokenizer.json" in message
        assert "with_tokenizer=False" in message and "\n" not in message
    assert load_model(str(tiny_llama.folder), with_tokenizer=False).tokenizer is None


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999, 0.0001])
def test_truncated_safetensors_raises_naming_the_file(tiny_llama, tmp_path, keep_fraction):
    folder = _copy_folder(tiny_llama.folder, tmp_path / "model")
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: max(1, int(len(data) * keep_fraction))])
    with pytest.raises(CheckpointError) as info:
        load_hf_folder(folder, dtype="float32", with_tokenizer=False)
    assert str(file) in str(info.value)


def test_corrupt_config_json_raises_naming_it(tiny_llama, tmp_path):
    folder = _copy_folder(tiny_llama.folder, tmp_path / "model")
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    with pytest.raises(CheckpointError) as info:
        load_hf_folder(folder, with_tokenizer=False)
    assert str(folder / "config.json") in str(info.value)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_folder(folder, with_tokenizer=False)


@pytest.mark.parametrize("change, tensor, expected_shape", [
    (dict(intermediate_size=96), "layers.0.w_gate", (64, 96)),
    (dict(hidden_size=48), "embed", (TINY_VOCAB, 48)),
    (dict(num_key_value_heads=4), "layers.0.wk", (64, 64)),
    (dict(vocab_size=100), "embed", (100, 64)),
])
def test_config_shape_mismatch_names_tensor_and_expected_shape(tiny_llama, tmp_path, change, tensor, expected_shape):
    folder = _copy_folder(tiny_llama.folder, tmp_path / "model")
    _edit_config(folder, **change)
    with pytest.raises(CheckpointError) as info:
        load_hf_folder(folder, with_tokenizer=False)
    message = str(info.value)
    assert repr(tensor) in message, message
    assert f"expects {expected_shape}" in message, message
    assert str(folder) in message


def test_unknown_architecture_raises_listing_supported(tiny_llama, tmp_path):
    folder = _copy_folder(tiny_llama.folder, tmp_path / "model")
    _edit_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as info:
        load_hf_folder(folder, with_tokenizer=False)
    message = str(info.value)
    assert "'gpt2'" in message
    for supported in ("llama", "qwen2"):
        assert supported in message


def test_mistral_sliding_window_is_not_silently_ignored(tiny_llama, tmp_path):
    """A Mistral config with a sliding window shorter than its context must be refused (as Qwen2's is).

    (Library bug at the time of writing: ``ModelConfig.from_hf_dict`` accepts ``model_type="mistral"``
    with ``sliding_window=4096`` and silently attends to the full context, so outputs beyond 4096
    tokens differ from the model's.)
    """
    folder = _copy_folder(tiny_llama.folder, tmp_path / "model")
    _edit_config(folder, model_type="mistral", sliding_window=4, max_position_embeddings=2048,
                 architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError, match="sliding_window"):
        load_hf_folder(folder, with_tokenizer=False)
    # no window (Mistral v0.2+ writes null) is the plain Llama path and loads
    _edit_config(folder, sliding_window=None)
    assert load_hf_folder(folder, with_tokenizer=False).config.model_type == "mistral"


def test_unknown_model_name_lists_known_names():
    with pytest.raises(ValueError) as info:
        load_model("no-such-model-anywhere")
    message = str(info.value)
    assert "no-such-model-anywhere" in message
    assert registry.KNOWN_MODELS  # the list is not empty
    for name in registry.KNOWN_MODELS:
        assert name in message


def test_load_tokenizer_by_folder_and_bad_names(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(tmp_path / "tok"))
    assert load_tokenizer(str(tmp_path / "tok"))("hello world")["input_ids"] == [1, 2]
    with pytest.raises(ValueError, match="'no-such-tokenizer': not a registry model name.*smollm2-135m"):
        load_tokenizer("no-such-tokenizer")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        load_tokenizer(str(tmp_path / "broken"))


def test_pickled_bin_folder_is_refused_without_unpickling(tiny_llama, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(tiny_llama.folder / "config.json", folder / "config.json")
    marker = tmp_path / "UNPICKLED"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))  # unpickling this creates the marker file

    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Trap()}))
    for load in (lambda: load_hf_folder(folder, with_tokenizer=False), lambda: load_model(str(folder))):
        with pytest.raises(CheckpointError) as info:
            load()
        assert "pytorch_model.bin" in str(info.value) and "safetensors" in str(info.value)
    assert not marker.exists(), "a pickle was unpickled"


def test_not_a_model_path_raises(tmp_path):
    (tmp_path / "weights.npz").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="weights.npz"):
        load_model(str(tmp_path / "weights.npz"))
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        load_gguf(tmp_path / "missing.gguf")


# ---------------------------------------------------------------------------- GGUF
def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp ``convert_hf_to_gguf.py`` Q/K permutation (rotate-half -> interleaved pairs)."""
    out = weight.shape[0]
    return weight.reshape(num_heads, 2, out // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(tiny, path: pathlib.Path, permute: bool = True) -> pathlib.Path:
    """Write ``tiny``'s transformers weights (float32) as a llama.cpp-style GGUF file."""
    import gguf

    hf = tiny.hf_model.config
    arch = "llama" if tiny.config.model_type == "llama" else "qwen2"
    state = _state_dict(tiny.hf_model)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{tiny.family}")
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_key_length(tiny.config.head_dim)
    writer.add_value_length(tiny.config.head_dim)
    writer.add_rope_freq_base(float(tiny.config.rope_theta))
    writer.add_layer_norm_rms_eps(float(hf.rms_norm_eps))
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not tiny.config.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(hf.num_hidden_layers):
        for theirs, gguf_name in names.items():
            key = f"model.layers.{i}.{theirs}"
            if key not in state:
                continue
            array = state[key]
            if arch == "llama" and permute and theirs.startswith("self_attn.q_proj"):
                array = _llama_cpp_permute(array, hf.num_attention_heads)
            elif arch == "llama" and permute and theirs.startswith("self_attn.k_proj"):
                array = _llama_cpp_permute(array, hf.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}", np.ascontiguousarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_llama_gguf(tiny_llama, tmp_path_factory):
    return write_tiny_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_mapping_reproduces_transformers_logits(tiny_models, tmp_path, tiny_llama_gguf, family):
    tiny = tiny_models[family]
    path = tiny_llama_gguf if family == "llama" else write_tiny_gguf(tiny, tmp_path / f"tiny-{family}.gguf")
    loaded = load_gguf(path, dtype="float32", with_tokenizer=False, progress=False)
    config = loaded.config
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (
        tiny.config.hidden_size, tiny.config.intermediate_size, tiny.config.num_layers)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == TINY_VOCAB
    assert config.tie_word_embeddings == tiny.config.tie_word_embeddings
    assert config.attention_bias == tiny.config.attention_bias
    assert config.rope_theta == tiny.config.rope_theta and config.model_type == tiny.config.model_type
    ours = _logits(loaded.params, config)
    reference = tiny.hf_logits(TOKENS)
    assert max_rel_error(ours, reference) <= 1e-4
    # the un-permutation restores exactly the HF rotate-half layout
    np.testing.assert_array_equal(np.asarray(loaded.params.layers[1].wq),
                                  np.asarray(tiny.params.layers[1].wq))
    np.testing.assert_array_equal(np.asarray(loaded.params.layers[1].wk),
                                  np.asarray(tiny.params.layers[1].wk))


def test_gguf_without_permutation_is_detected_by_logits(tiny_llama, tmp_path):
    """Control: a llama GGUF written without llama.cpp's permutation loads to wrong logits."""
    path = write_tiny_gguf(tiny_llama, tmp_path / "unpermuted.gguf", permute=False)
    loaded = load_gguf(path, dtype="float32", with_tokenizer=False, progress=False)
    assert max_rel_error(_logits(loaded.params, loaded.config), tiny_llama.hf_logits(TOKENS)) > 1e-3


def test_load_model_routes_gguf_files(tiny_llama_gguf):
    loaded = load_model(str(tiny_llama_gguf), dtype="bfloat16", with_tokenizer=False, progress=False)
    assert loaded.info["format"] == "gguf" and loaded.config.dtype == "bfloat16"
    assert loaded.params.layers[0].wq.dtype == jnp.bfloat16


def _truncated_sizes(size: int):
    return {"header": 64, "half": size // 2, "last byte": size - 1}


@pytest.mark.parametrize("where", ["header", "half", "last byte"])
def test_truncated_gguf_raises_naming_the_file(tiny_llama_gguf, tmp_path, where):
    data = tiny_llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: _truncated_sizes(len(data))[where]])
    with pytest.raises(CheckpointError) as info:
        load_gguf(cut, dtype="float32", with_tokenizer=False, progress=False)
    assert str(cut) in str(info.value)


def test_truncated_real_smollm2_gguf_raises(tmp_path):
    """The first 1 MB of the cached SmolLM2 GGUF (skipped when it is not cached; never downloads)."""
    asset = registry.KNOWN_MODELS["smollm2-135m"]
    source = registry.cache_dir() / asset.filename
    if not source.is_file():
        pytest.skip(f"{source} not cached")
    cut = tmp_path / asset.filename
    with open(source, "rb") as handle:
        cut.write_bytes(handle.read(1 << 20))
    with pytest.raises(CheckpointError) as info:
        load_gguf(cut, dtype="float32", with_tokenizer=False, progress=False)
    assert str(cut) in str(info.value)


def test_gguf_unknown_architecture_raises(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as info:
        load_gguf(path, with_tokenizer=False, progress=False)
    assert "'gpt2'" in str(info.value) and "llama" in str(info.value) and str(path) in str(info.value)


# ---------------------------------------------------------------------------- converted cache of a registry model
def _corrupt_largest_file(folder: pathlib.Path) -> pathlib.Path:
    """Flip bytes all over the largest array file of an orbax checkpoint (same size)."""
    target = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    for offset in range(64, len(data), 97):
        data[offset] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def test_corrupt_converted_cache_is_reported_in_one_line_and_converted_again(
        tiny_llama_gguf, tmp_path, monkeypatch, capfd):
    from jaxspec.models import loading

    name = "tiny-registry-model"
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(registry.KNOWN_MODELS, name, registry.KNOWN_MODELS["smollm2-135m"])
    monkeypatch.setattr(registry, "resolve_model_file", lambda source, progress=True: tiny_llama_gguf)
    monkeypatch.setattr(loading, "load_gguf_tokenizer", lambda path: None)  # the tiny GGUF carries none

    first = load_model(name, dtype="float32", with_tokenizer=False, progress=False)
    converted = tmp_path / "cache" / "converted" / name
    assert (converted / "jaxspec_config.json").is_file()
    capfd.readouterr()
    _corrupt_largest_file(converted / "params")

    again = load_model(name, dtype="float32", with_tokenizer=False, progress=False)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n" + "\n".join(lines[:20])
    assert "converted cache of 'tiny-registry-model' is unusable, converting it again" in lines[0]
    assert str(converted / "params") in lines[0] and "Traceback" not in err
    for path, value in jax.tree_util.tree_leaves_with_path(first.params):
        np.testing.assert_array_equal(np.asarray(dict(jax.tree_util.tree_leaves_with_path(again.params))[path]),
                                      np.asarray(value), err_msg=str(path))
    # The rewritten cache restores cleanly (nothing said).
    load_model(name, dtype="float32", with_tokenizer=False, progress=False)
    assert capfd.readouterr().err.strip() == ""


def test_a_conversion_racing_another_keeps_the_first_complete_copy(tiny_llama_gguf, tmp_path, monkeypatch):
    """Two processes converting one registry model at once: each writes its copy beside the cache folder
    and renames it in; one that finds a complete copy already there drops its own (no half-written or
    deleted files for the other), and nothing is left beside the folder."""
    from jaxspec.models import loading

    name = "tiny-registry-model"
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(registry.KNOWN_MODELS, name, registry.KNOWN_MODELS["smollm2-135m"])
    monkeypatch.setattr(registry, "resolve_model_file", lambda source, progress=True: tiny_llama_gguf)
    monkeypatch.setattr(loading, "load_gguf_tokenizer", lambda path: None)
    converted = tmp_path / "cache" / "converted" / name
    save = loading.save_checkpoint
    seen = []

    def other_process_finishes_first(folder, model):  # the other converter renames its copy in meanwhile
        seen.append(pathlib.Path(folder))
        save(folder, model)
        save(converted, model)
        (converted / "other.txt").write_text("the other process's copy")

    monkeypatch.setattr(loading, "save_checkpoint", other_process_finishes_first)
    model = load_model(name, dtype="float32", with_tokenizer=False, progress=False)
    assert seen and seen[0].parent == converted.parent and seen[0] != converted  # written beside, not in place
    assert (converted / "other.txt").is_file()  # the first complete copy stays
    assert sorted(p.name for p in converted.parent.iterdir()) == [name]  # our staging copy was dropped
    monkeypatch.setattr(loading, "save_checkpoint", save)
    again = load_model(name, dtype="float32", with_tokenizer=False, progress=False)  # restores the kept copy
    for path, value in jax.tree_util.tree_leaves_with_path(model.params):
        np.testing.assert_array_equal(np.asarray(dict(jax.tree_util.tree_leaves_with_path(again.params))[path]),
                                      np.asarray(value), err_msg=str(path))


def test_converted_cache_can_be_turned_off(tiny_llama_gguf, tmp_path, monkeypatch):
    """``$JAXSPEC_CONVERTED_CACHE=0``: a registry model is dequantised from its GGUF file on every load;
    no converted copy is read or written (a bad value is refused naming it)."""
    from jaxspec.models import loading

    name = "tiny-registry-model"
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(registry.KNOWN_MODELS, name, registry.KNOWN_MODELS["smollm2-135m"])
    monkeypatch.setattr(registry, "resolve_model_file", lambda source, progress=True: tiny_llama_gguf)
    monkeypatch.setattr(loading, "load_gguf_tokenizer", lambda path: None)
    reference = load_model(name, dtype="float32", with_tokenizer=False, progress=False)  # writes the copy
    assert (tmp_path / "cache" / "converted" / name / "jaxspec_config.json").is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("the converted copy was used")

    monkeypatch.setattr(loading, "save_checkpoint", refuse)
    monkeypatch.setattr(loading, "load_checkpoint", refuse)
    monkeypatch.setenv("JAXSPEC_CONVERTED_CACHE", "0")
    fresh = load_model(name, dtype="float32", with_tokenizer=False, progress=False)
    for path, value in jax.tree_util.tree_leaves_with_path(reference.params):
        np.testing.assert_array_equal(np.asarray(dict(jax.tree_util.tree_leaves_with_path(fresh.params))[path]),
                                      np.asarray(value), err_msg=str(path))
    monkeypatch.setenv("JAXSPEC_CONVERTED_CACHE", "no")
    with pytest.raises(ValueError, match=r"\$JAXSPEC_CONVERTED_CACHE='no': use 1"):
        load_model(name, dtype="float32", with_tokenizer=False, progress=False)
