"""Build a fast tokenizer from the tokenizer a GGUF file embeds, with the ``tokenizers`` library.

transformers can do this too, but its GGUF reader imports torch; the demo must run on a CPU
machine without torch. Supported: byte-level BPE vocabularies (``tokenizer.ggml.model ==
"gpt2"``: SmolLM2, Qwen2/2.5, Llama-3.x) with the pre-tokenizers named by
``tokenizer.ggml.pre`` below. Other kinds fall back to transformers (which needs torch) with a
clear error if that is unavailable.
"""

from __future__ import annotations

import pathlib

import numpy as np

# Split patterns of the pre-tokenizers (the published regexes of each model family).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "qwen2", "deepseek-r1-qwen", "llama-bpe", "llama3")

CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4


class UnsupportedGGUFTokenizer(ValueError):
    """The GGUF's tokenizer is not byte-level BPE: the caller falls back to transformers."""


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    if len(field.data) > 1 or (field.types and field.types[0].name == "ARRAY"):
        values = [field.parts[i] for i in field.data]
        if field.types[-1].name == "STRING":
            return [bytes(v).decode("utf-8", errors="replace") for v in values]
        return [v.tolist()[0] for v in values]
    value = field.parts[field.data[0]]
    if field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return np.asarray(value).tolist()[0]


def _pre_tokenizer(kind: str, path):
    from tokenizers import Regex, pre_tokenizers

    if kind in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":  # SmolLM2's tokenizer.json: digits one by one, then GPT-2 byte-level splitting
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
             "llama3": _LLAMA3_SPLIT}.get(kind)
    if split is None:
        raise ValueError(f"{path}: GGUF pre-tokenizer {kind!r} is not supported; supported: {SUPPORTED_PRE_TOKENIZERS}")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(path):
    """A ``transformers.PreTrainedTokenizerFast`` for the byte-level BPE tokenizer inside ``path``."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    path = pathlib.Path(path)
    reader = gguf.GGUFReader(str(path))
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedGGUFTokenizer(f"tokenizer.ggml.model={kind!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges") or []
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                     byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"), path)
    tokenizer.decoder = decoders.ByteLevel()
    special = [AddedToken(t, normalized=False, special=True) for t, kind_ in zip(tokens, token_types)
               if kind_ == CONTROL_TOKEN]
    user = [AddedToken(t, normalized=False, special=False) for t, kind_ in zip(tokens, token_types)
            if kind_ == USER_DEFINED_TOKEN]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)

    def token_at(key):
        index = _field(reader, key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=eos,
        pad_token=token_at("tokenizer.ggml.padding_token_id"), unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        clean_up_tokenization_spaces=False)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        wrapped.chat_template = template
    return wrapped
