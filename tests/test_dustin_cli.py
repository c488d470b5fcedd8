"""``generate --method dustin | streaming | snapkv | quest | magicdec``, ``dustin-profile`` and
``dustin-quality`` on tiny random models (CPU, seconds): the CLI paths, their JSON and their errors."""

import json

import numpy as np
import pytest

from experiments.run import main

PROMPT = "Once upon a time, in a land far away, there lived a curious fox who loved long stories. " * 4


def _tiny_folder(tmp_path, seed=0, name="tiny-llama"):
    """The conftest tiny Llama (vocab 128, 3 layers, 4 q / 2 kv heads) with a character tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import build_tiny_hf_model

    folder = tmp_path / name
    build_tiny_hf_model("llama", seed=seed).save_pretrained(str(folder))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): i + 3 for i, c in enumerate(range(32, 127))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dustin_cli")
    return _tiny_folder(root, 0, "target"), _tiny_folder(root, 1, "draft")


def _base(folder, *extra):
    return ["generate", "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "12", "--dtype", "float32",
            "--no-warmup", "--no-chat", "--gamma", "3", *extra]


def _results(path):
    return json.loads(path.read_text())["results"]


def test_generate_sparse_methods(folders, tmp_path):
    """Every sparse method runs through `generate`; with k >= the context each equals dense ClassicSD,
    with k = 128 < context (~360 tokens) the run is sparse and labelled."""
    target, draft = folders
    dense = tmp_path / "sd.json"
    assert main(_base(target, "--method", "sd", "--draft", str(draft), "--out", str(dense))) == 0
    dense_tokens = _results(dense)["tokens"]
    for method, draft_args in (("dustin", ["--draft", str(draft)]), ("dustin", ["--draft-skip", "mlp:1"]),
                               ("streaming", ["--draft", str(draft)]), ("snapkv", ["--draft", str(draft)]),
                               ("quest", ["--draft", str(draft)]), ("magicdec", ["--draft", str(draft)]),
                               ("magicdec", [])):
        big = tmp_path / f"{method}-big.json"
        assert main(_base(target, "--method", method, "--budget", "2048", "--out", str(big), *draft_args)) == 0
        results = _results(big)
        assert results["sparse"]["budget"] == 2048 and results["method"] == method
        if draft_args and draft_args[0] == "--draft" or method == "magicdec":
            # k covers the ~360-token history: exactly dense verification (MagicDec: dense by construction)
            assert results["tokens"] == dense_tokens, (method, draft_args)
        small = tmp_path / f"{method}-small.json"
        assert main(_base(target, "--method", method, "--budget", "128", "--out", str(small), *draft_args)) == 0
        results = _results(small)
        assert len(results["tokens"][0]) == 12 and results["metrics"]["tau"] >= 1
    modes = {}
    for mode in ("hybrid", "target", "draft"):
        path = tmp_path / f"dustin-{mode}.json"
        assert main(_base(target, "--method", "dustin", "--budget", "128", "--dustin-mode", mode, "--draft",
                          str(draft), "--out", str(path))) == 0
        sparse = _results(path)["sparse"]
        modes[mode] = sparse["m"]
        assert sparse["profile"] is None and "unprofiled" in sparse["note"]
    assert modes == {"hybrid": (128 - 4 - 32) // 2, "target": 0, "draft": 128 - 4 - 32}


@pytest.mark.parametrize("extra,message", [
    (["--method", "dustin", "--budget", "300"], "k=300 is not supported"),
    (["--method", "dustin", "--budget", "64"], "one of 128, 256, 512, 1024, 2048"),
    (["--method", "streaming"], "needs --budget K"),
    (["--method", "dustin", "--budget", "128"], "needs a draft"),
    (["--method", "dustin", "--budget", "128", "--draft-skip", "mlp:1", "--dustin-profile", "/no/such/file.json"],
     "does not exist"),
    (["--method", "quest", "--budget", "128", "--draft-skip", "mlp:1", "--dustin-profile", "x.json"],
     "--dustin-profile is a dustin option"),
])
def test_generate_bad_input(folders, capsys, extra, message):
    target, _ = folders
    assert main(_base(target, *extra)) == 2
    assert message in capsys.readouterr().err
