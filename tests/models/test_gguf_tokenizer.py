"""Our torch-free GGUF tokenizer builder vs transformers' GGUF tokenizer on the real files."""

import pathlib

import pytest

from jaxspec.models import registry
from jaxspec.models.gguf_tokenizer import tokenizer_from_gguf

TEXT = (pathlib.Path(__file__).resolve().parents[2] / "experiments" / "prompts" / "long_demo.txt").read_text() + (
    "\n\n  Hello   world!\tTabs\r\n it's 'quoted' — émigré naïve 你好 <|im_end|> <|endoftext|>  In 2026: 12345.  ")


def _compare(name):
    from transformers import AutoTokenizer

    path = registry.resolve_model_file(name, progress=False)
    ours = tokenizer_from_gguf(path)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = ours(TEXT)["input_ids"]
    assert ids == reference(TEXT)["input_ids"]
    assert ours.decode(ids) == TEXT
    assert ours.eos_token == reference.eos_token
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers():
    _compare("smollm2-135m")


@pytest.mark.qwen
def test_qwen_tokenizer_matches_transformers():
    _compare("qwen2.5-coder-0.5b")
