"""``pair-speed``: its input checks, row windows, agreement, trace summary and round bytes on hand-made
inputs, and one small end-to-end run on the real SmolLM2-135M as both target and draft (CPU, float32)."""

import json
import pathlib
import re

import numpy as np
import pytest

from experiments import choice_table, pair_speed
from experiments.dustin_speed import method_round_bytes
from experiments.run import build_parser, main
from jaxspec.config import ModelConfig
from jaxspec.dustin.config import DustinConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
TEXT = str(REPO / "experiments" / "prompts" / "emma_qwen_64k.txt")


@pytest.fixture(scope="module")
def one_load_per_model():
    """Each (model, dtype) loaded once for this module's end-to-end runs (pair-speed loads the target and the
    draft per call; nothing here changes a model's weights)."""
    from jaxspec.models import loading

    real, cache = loading.load_model, {}

    def load_once(source, dtype="float32", **kwargs):
        key = (source, dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = real(source, dtype=dtype, **kwargs)
        return cache[key]

    loading.load_model = load_once
    yield cache
    loading.load_model = real


def _args(*extra, text_file=TEXT):
    """Parsed ``pair-speed`` arguments: one case of 160 tokens, k = 128, no Dustin profile, plus ``extra``."""
    return build_parser().parse_args(["pair-speed", "--contexts", "160", "--batches", "2", "--budget", "128",
                                      "--methods", "sd,magicdec", "--dustin-profile", "", "--text-file", text_file,
                                      *extra])


# ---------------------------------------------------------------------------- check_args
def test_check_args_accepts_good_input():
    contexts, batches, methods = pair_speed.check_args(_args("--contexts", "160,320", "--batches", "1,4",
                                                             "--methods", " sd, streaming ,quest",
                                                             "--profile-batches", "4", "--trace-batches", ""))
    assert (contexts, batches, methods) == ([160, 320], [1, 4], ["sd", "streaming", "quest"])
    # ClassicSD alone reads no budget: a context of at most k is fine for it
    assert pair_speed.check_args(_args("--contexts", "128", "--methods", "sd"))[0] == [128]


@pytest.mark.parametrize("extra, message", [
    (["--methods", "sd,bogus"], "--methods='sd,bogus': choose one or more of sd, magicdec, dustin, streaming, quest"),
    (["--methods", "ar"], "--methods='ar'"),  # AR is the baseline, not a method to name
    (["--methods", ""], "--methods='': choose one or more of"),
    (["--methods", " , "], "--methods=' , ': choose one or more of"),
    (["--contexts", "128,160", "--methods", "sd,magicdec"], "--contexts [128] are not longer than --budget 128"),
    (["--contexts", "100,128,160", "--methods", "streaming"], "--contexts [100, 128] are not longer than --budget 128"),
    (["--methods", "quest", "--budget", "100"], "k=100 is not supported"),
    (["--backend-check=-1"], "--backend-check=-1: a token count >= 0"),
    (["--profile-batches", "x"], "--profile-batches='x': expected comma-separated integers"),
    (["--profile-batches", "2,0"], "--profile-batches='2,0': expected zero or more integers >= 1"),
    (["--trace-batches=-3"], "--trace-batches='-3': expected zero or more integers >= 1"),
    (["--contexts", "160,x"], "--contexts='160,x': expected comma-separated integers"),
    (["--batches", ""], "--batches='': expected more integers >= 1"),
    (["--gamma", "0"], "--gamma=0: must be >= 1"),
    (["--row-stride", "0"], "--row-stride=0: must be >= 1"),
    (["--methods", "dustin", "--dustin-profile", "/no/such/profile.json"],
     "--dustin-profile /no/such/profile.json: no such file"),
    (["--arbitrate-tail", "4"], "--arbitrate-tail refines --arbitrate ROUNDS"),
    (["--arbitrate", "8", "--methods", "sd,quest"], "quest is not run under the measured choice"),
    (["--arbitrate=-1"], "--arbitrate=-1 / --arbitrate-tail=0: rounds >= 0"),
    (["--arbitrate", "8", "--arbitrate-tail", "8", "--arbitrate-table-tail-after", "32"],
     "--arbitrate-table-tail-after=32: rounds >= 1 (0 = off), and it needs --arbitrate-table"),
    (["--arbitrate-table-tail-after=-2"], "--arbitrate-table-tail-after=-2: rounds >= 1"),
    (["--arbitrate-table-tail-margin", "0.1"], "--arbitrate-table-tail-margin=0.1: a share in [0, 1)"),
    (["--repeats", "0"], "--repeats=0: timed (AR, method) pairs per method, >= 1"),
])
def test_check_args_refuses_bad_input(extra, message):
    with pytest.raises(ValueError) as err:
        pair_speed.check_args(_args(*extra))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_check_args_refuses_a_missing_text_file(tmp_path):
    missing = tmp_path / "no-such.txt"
    with pytest.raises(ValueError) as err:
        pair_speed.check_args(_args(text_file=str(missing)))
    assert str(err.value) == f"--text-file {missing}: no such file"


def test_bad_input_is_one_line_before_any_model_loads(tmp_path, capsys):
    # a model that does not exist: the check must refuse the methods before trying to load it
    argv = ["pair-speed", "--model", "no-such-model", "--draft", "no-such-model", "--methods", "sd,nope",
            "--text-file", TEXT, "--out", str(tmp_path / "out.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --methods='sd,nope'") and "\n" not in err
    assert not (tmp_path / "out.json").exists()


# ---------------------------------------------------------------------------- row_windows
def test_row_windows_rows_are_strided_slices():
    ids = [(7 * i + 3) % 1000 for i in range(700)]
    windows = pair_speed.row_windows(ids, context=100, batch=4, stride=200)
    assert windows.shape == (4, 100) and windows.dtype == np.int32
    for b in range(4):
        assert windows[b].tolist() == ids[b * 200: b * 200 + 100]
    # exactly enough tokens: the last row ends at the last token
    exact = pair_speed.row_windows(ids[:700], context=100, batch=7, stride=100)
    assert exact[-1].tolist() == ids[600:700]
    # overlapping rows (stride < context)
    overlap = pair_speed.row_windows(ids, context=50, batch=3, stride=10)
    assert overlap[2].tolist() == ids[20:70] and overlap[1, 10:].tolist() == overlap[2, :40].tolist()


def test_row_windows_too_short_text_names_the_counts():
    with pytest.raises(ValueError) as err:
        pair_speed.row_windows(list(range(100)), context=60, batch=3, stride=30)
    message = str(err.value)
    assert "the text has 100 tokens" in message and "3 rows of 60 tokens 30 apart need 120" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match="has 119 tokens"):
        pair_speed.row_windows(list(range(119)), context=60, batch=3, stride=30)
    assert pair_speed.row_windows(list(range(120)), context=60, batch=3, stride=30).shape == (3, 60)


# ---------------------------------------------------------------------------- agreement
def test_agreement_match_rate_and_first_divergence():
    tokens = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    reference = np.array([[1, 2, 3, 4], [1, 9, 3, 0], [0, 6, 7, 8]])
    result = pair_speed.agreement(tokens, reference)
    assert result == {"match_rate": 9 / 12, "first_divergence": [None, 1, 0], "identical": False}
    # a divergence only at the last position
    result = pair_speed.agreement(np.array([[4, 4, 4]]), np.array([[4, 4, 5]]))
    assert result == {"match_rate": 2 / 3, "first_divergence": [2], "identical": False}
    same = pair_speed.agreement(reference, reference.copy())
    assert same == {"match_rate": 1.0, "first_divergence": [None, None, None], "identical": True}
    json.dumps(same)  # plain Python types: it goes into the results file


# ---------------------------------------------------------------------------- per_round_trace
def _plane(busy, span, launches, kernels=12):
    return {"busy_s": busy, "span_s": span, "launches": launches, "distinct_kernels": kernels,
            "top_kernels": [[f"kernel{i}", 0.01 * (kernels - i), 3] for i in range(kernels)]}


def test_per_round_trace_from_a_synthetic_trace():
    trace = {"wall_s": 0.5, "planes": {"/device:GPU:0": _plane(0.2, 0.4, 120),
                                       "/device:GPU:1": _plane(0.1, 0.1, 7)}}
    out = pair_speed.per_round_trace(trace, 4)
    assert out["plane"] == "/device:GPU:0"  # the first device plane
    assert out["launches_per_round"] == 30.0
    assert out["busy_share"] == pytest.approx(0.5)
    assert out["busy_share_of_wall"] == pytest.approx(0.4)
    assert (out["wall_s"], out["busy_s"], out["span_s"], out["launches"], out["rounds"]) == (0.5, 0.2, 0.4, 120, 4)
    assert out["distinct_kernels"] == 12
    assert out["top_kernels"] == trace["planes"]["/device:GPU:0"]["top_kernels"][:10]
    # no round count: no launches per round; an empty span or wall: no share (not a division by zero)
    out = pair_speed.per_round_trace({"wall_s": 0.0, "planes": {"p": _plane(0.0, 0.0, 5, kernels=2)}}, None)
    assert "launches_per_round" not in out and out["busy_share"] is None and out["busy_share_of_wall"] is None
    assert len(out["top_kernels"]) == 2


def test_per_round_trace_passes_errors_through():
    error = {"error": "RuntimeError('profiler unavailable')"}
    assert pair_speed.per_round_trace(error, 7) is error
    empty = {"wall_s": 0.3, "planes": {}}
    assert pair_speed.per_round_trace(empty, 7) is empty


# ---------------------------------------------------------------------------- method_round_bytes
#: target: untied head, 3 layers, 4 query / 2 KV heads of 8; draft: tied, 2 layers, 4 query / 2 KV heads of 2
TARGET = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_word_embeddings=False, attention_backend="xla")
DRAFT = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=2, tie_word_embeddings=True, attention_backend="xla")
TARGET_BYTES, DRAFT_BYTES = 100_000, 30_000
BATCH, CONTEXT, BUDGET, GAMMA = 2, 400, 128, 3


def _bytes(method, context=CONTEXT, **kw):
    return method_round_bytes(method, target_config=TARGET, draft_config=DRAFT, batch=BATCH, context=context,
                              budget=BUDGET, gamma=GAMMA, target_bytes=TARGET_BYTES, draft_bytes=DRAFT_BYTES, **kw)


def test_method_round_bytes_by_hand():
    # bfloat16 (2 bytes). Weights read per forward: the target's untied embedding table is not read
    # (one row per sequence): 100_000 - 100 * 16 * 2 = 96_800; the draft's tied table is its LM head: 30_000.
    target_w, draft_w = 96_800, 30_000
    # K and V of every layer: target 2 * 3 layers * 2 rows * 2 KV heads * 8 * 2 bytes = 384 per position,
    # draft 2 * 2 * 2 * 2 * 2 * 2 = 64 per position
    target_kv, draft_kv = 384, 64
    draft_round = 3 * (draft_w + draft_kv * 400)  # gamma = 3 draft forwards over the whole context
    assert draft_round == 166_800
    assert _bytes("sd") == draft_round + target_w + target_kv * 400 == 417_200
    assert _bytes("classic") == _bytes("sd")
    # MagicDec: the draft reads k = 128 positions; dense verification
    assert _bytes("magicdec") == 3 * (draft_w + draft_kv * 128) + target_w + target_kv * 400 == 364_976
    # StreamingLLM: the target reads k positions
    assert _bytes("streaming") == draft_round + target_w + target_kv * 128 == 312_752
    # Quest: 2 dense layers over 400; the third over 128 plus a min and a max key of each of the 25 pages
    per_layer = 2 * 2 * 2 * 8 * 2  # (K+V or min+max) * rows * KV heads * head_dim * bytes = 128 per position
    assert _bytes("quest") == draft_round + target_w + 2 * per_layer * 400 + per_layer * (128 + 25) == 385_584
    # 401 positions: 26 pages (the last one partial)
    assert _bytes("quest", context=401) == (3 * (draft_w + draft_kv * 401) + target_w + 2 * per_layer * 401
                                            + per_layer * (128 + 26)) == 386_160
    # Dustin: the target over k plus the selection reading the keys of the SRH KV groups over the whole
    # context: target query heads 0, 1, 2 -> KV groups {0, 1}; the first draft SRH layer's heads 0, 1 -> group {0}
    # (only the first draft SRH layer counts: the second one's head 2, group 1, is not read)
    dustin = DustinConfig(budget=128, target_layer=1, target_heads=(0, 1, 2), draft_layers=(0, 1),
                          draft_heads=((0, 1), (2,)))
    selection = 2 * 2 * 400 * (2 * 8 + 1 * 2)  # bytes * rows * positions * (groups x head_dim, both models)
    assert selection == 28_800
    assert _bytes("dustin", dustin=dustin) == draft_round + target_w + target_kv * 128 + selection == 341_552
    # a target-only Dustin (no draft SRH layer) reads only the target groups' keys
    target_only = DustinConfig(budget=128, target_heads=(3,), mode="target")
    assert _bytes("dustin", dustin=target_only) == draft_round + target_w + target_kv * 128 + 2 * 2 * 400 * 8
    # scoring every KV head in one product reads both KV heads of both layers
    assert (_bytes("dustin", dustin=dustin.replace(scoring_layout="heads"))
            == draft_round + target_w + target_kv * 128 + 2 * 2 * 400 * (2 * 8 + 2 * 2))
    # by round phase (a device trace's split): the same bytes, summing to the total
    assert _bytes("dustin", dustin=dustin, split=True) == {"draft": draft_round,
                                                           "verification": target_w + target_kv * 128,
                                                           "selection": selection}
    assert _bytes("magicdec", split=True) == {"draft": 3 * (draft_w + draft_kv * 128),
                                              "verification": target_w + target_kv * 400}
    for method in ("sd", "classic", "streaming", "quest"):
        assert sum(_bytes(method, split=True).values()) == _bytes(method), method


def test_method_round_bytes_orders_and_errors():
    for method in ("magicdec", "streaming", "quest"):
        assert _bytes(method) < _bytes("sd"), method
    # a budget covering the context: MagicDec and StreamingLLM read what ClassicSD reads
    assert _bytes("magicdec", context=BUDGET) == _bytes("sd", context=BUDGET)
    assert _bytes("streaming", context=BUDGET) == _bytes("sd", context=BUDGET)
    with pytest.raises(ValueError, match="unknown method 'ar'"):
        _bytes("ar")
    with pytest.raises(ValueError, match="unknown method 'bogus'"):
        _bytes("bogus")
    with pytest.raises(ValueError, match="needs the DustinConfig"):
        _bytes("dustin")


def test_every_method_builds_its_policies_and_bytes():
    """``build_policies`` for each method (no model loads): dense verification exactly for sd / magicdec,
    and every method's verify policy feeds ``method_round_bytes`` (Dustin through its DustinConfig)."""
    from jaxspec.decoding.policies import DenseVerify

    target = TARGET.replace(num_layers=4)
    draft = DRAFT.replace(num_layers=4)
    args = _args("--methods", ",".join(pair_speed.METHODS), "--contexts", "400")
    assert pair_speed.check_args(args)[2] == list(pair_speed.METHODS)
    assert not set(pair_speed.SPARSE_DRAFT_KV) & set(pair_speed.DEFAULT_METHODS)  # asked for by name
    assert not set(pair_speed.SELF_METHODS) & set(pair_speed.DEFAULT_METHODS)
    bytes_of = {}
    for method in pair_speed.METHODS:
        draft_policy, verify_policy, description = pair_speed.build_policies(args, method, target, draft)
        assert description["method"] == method
        assert isinstance(verify_policy, DenseVerify) == (method in pair_speed.DENSE_METHODS), method
        dustin = verify_policy.dustin if method in pair_speed.PROFILED_METHODS else None
        if dustin is not None:
            assert dustin.budget == 128 and dustin.mode == "hybrid"
            want = "streaming" if method == "dustin-self" else pair_speed.SPARSE_DRAFT_KV.get(method, "full")
            assert dustin.draft_kv == want == draft_policy.draft_kv
        self_draft = method in pair_speed.SELF_METHODS
        if self_draft:  # the target drafts: its policy builds its own state, no mask traced
            assert draft_policy.config == target and draft_policy.prefill(None, None, None, 0) == {}
        bytes_of[method] = method_round_bytes(pair_speed.SELF_BYTES_METHOD.get(method, method), target_config=target,
                                              draft_config=target if self_draft else draft, batch=1, context=400,
                                              budget=128, gamma=4, target_bytes=10**6,
                                              draft_bytes=10**6 if self_draft else 10**5, dustin=dustin)
        assert bytes_of[method] > 0
    # Dustin-H's self-draft signal is the self-draft's lookahead at the target's own SRH layer and heads
    dustin_self = pair_speed.build_policies(args, "dustin-self", target, draft)[1].dustin
    assert dustin_self.draft_layers == (dustin_self.target_layer,)
    assert dustin_self.draft_heads == (tuple(dustin_self.target_heads),)
    # a self-draft reads the target's weights gamma times: its round reads more than the 0.5B-style draft's
    assert bytes_of["dustin-self"] > bytes_of["dustin-kv-streaming"] and bytes_of["magicdec-self"] > bytes_of["magicdec"]
    # the sparse-draft variants read less than full-KV Dustin: gamma draft steps over ~k instead of 400 positions
    per_position = 2 * draft.num_layers * draft.num_kv_heads * draft.head_dim * 2  # K and V, bf16
    window = pair_speed.build_policies(args, "dustin-kv-verify-set", target, draft)[1].dustin.draft_window_size
    assert bytes_of["dustin"] - bytes_of["dustin-kv-streaming"] == 4 * (400 - 128) * per_position
    assert bytes_of["dustin"] - bytes_of["dustin-kv-verify-set"] == 4 * (400 - 128 - window) * per_position


# ---------------------------------------------------------------------------- end to end
E2E = ["pair-speed", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--dtype", "float32",
       "--attention-backend", "xla", "--contexts", "160", "--batches", "2", "--budget", "128",
       "--max-new-tokens", "6", "--methods", "sd,magicdec,streaming", "--dustin-profile", "",
       "--text-file", TEXT, "--copy-gib", "0.01"]


@pytest.mark.slow
def test_pair_speed_end_to_end_and_resume(tmp_path, monkeypatch, one_load_per_model):
    """Real SmolLM2-135M as target and draft (greedy, float32): dense verification is AR token for token,
    the JSON holds the bandwidth, the bytes and the rows, and a rerun resumes without measuring again."""
    out = tmp_path / "pair.json"
    assert main(E2E + ["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["experiment"] == "pair-speed"
    bandwidth = data["cases"]["copy_bandwidth"]["bandwidth_Bps"]
    assert bandwidth > 0 and data["cases"]["copy_bandwidth"]["bytes"] > 0
    case = data["cases"]["ctx160/b2"]
    assert (case["context"], case["batch"], case["row_starts"]) == (160, 2, [0, 2048])
    assert case["capacity"] >= 160 + 6 + 4
    gamma = data["config"]["gamma"]
    assert gamma == 4
    assert data["config"]["keep_finished_rows"] is False  # finished rows read one slot (docs/methods.md §5.7)
    for method in ("sd", "magicdec", "streaming"):
        record = case[method]
        tau = record["metrics"]["tau"]
        assert 1 <= tau <= gamma + 1, (method, tau)
        assert record["tok_s"] > 0 and record["paired_ar_tok_s"] > 0
        assert record["speedup_vs_ar"] == pytest.approx(record["tok_s"] / record["paired_ar_tok_s"])
        assert len(record["metrics"]["acceptance_rate_per_position"]) == gamma
        assert len(record["tokens_row0"]) == 6
        agreement = record["agreement_with_ar"]
        assert len(agreement["first_divergence"]) == 2
        if method in pair_speed.DENSE_METHODS:
            # greedy speculative decoding with dense verification is AR, token for token, in float32
            assert agreement["identical"] is True and agreement["match_rate"] == 1.0, (method, agreement)
            assert agreement["first_divergence"] == [None, None]
            assert record["tokens_row0"] == case["ar"]["tokens_row0"]
    assert case["magicdec"]["description"]["draft_kv"].startswith("StreamingLLM view, 4 sinks + 124 window")
    # the three round loops were built at once, in three threads, before the first method ran
    assert case["precompile"]["methods"] == ["sd", "magicdec", "streaming"]
    assert (case["precompile"]["programs"], case["precompile"]["threads"]) == (3, 3)
    assert case["streaming"]["description"]["window"] == 124
    # the rooflines from the bytes at the measured bandwidth; the draft is the target, so a ClassicSD
    # round reads exactly gamma + 1 target decode steps
    step = case["ar"]["step_bytes"]["total"]
    assert case["ar"]["roofline_tok_s"] == pytest.approx(2 / (step / bandwidth))
    assert case["sd"]["round_bytes"] == (gamma + 1) * step
    assert case["magicdec"]["round_bytes"] < case["sd"]["round_bytes"]
    assert case["streaming"]["round_bytes"] < case["sd"]["round_bytes"]
    assert len(case["ar"]["runs"]) == 3 and [r["before"] for r in case["ar"]["runs"]] == ["sd", "magicdec",
                                                                                           "streaming"]
    # the row table: AR first, then each method with its tau and match rate
    rows = case["rows"]
    assert [r["method"] for r in rows] == ["ar", "sd", "magicdec", "streaming"]
    assert rows[0]["speedup"] == 1.0 and rows[0]["tau"] == 1.0
    for row in rows[1:]:
        record = case[row["method"]]
        assert row["tau"] == record["metrics"]["tau"] and row["match_ar"] == record["agreement_with_ar"]["match_rate"]
        assert row["speedup"] == pytest.approx(record["speedup_vs_ar"]) and row["tok_s"] > 0
        assert row["compile_s"] > 0
    assert data["models"]["target"]["config"]["num_layers"] == 30

    # a rerun with the same --out resumes: no bandwidth measurement, no prefill, no decoding
    def refuse(*args, **kwargs):
        raise AssertionError("the resumed case was measured again")

    monkeypatch.setattr("experiments.decode_speed.copy_bandwidth", refuse)
    monkeypatch.setattr("jaxspec.decoding.autoregressive.prefill", refuse)
    monkeypatch.setattr("jaxspec.decoding.speculative.speculative_generate", refuse)
    assert main(E2E + ["--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["cases"] == data["cases"]

    # an interrupted case ("complete": false, magicdec and streaming not measured) measures only those
    partial = json.loads(out.read_text())
    case = partial["cases"]["ctx160/b2"]
    for name in ("magicdec", "streaming"):
        del case[name]
    case["complete"] = False
    case["ar"] = {"runs": case["ar"]["runs"][:1]}
    del case["rows"]
    out.write_text(json.dumps(partial))
    monkeypatch.undo()
    from jaxspec.decoding import speculative

    measured = []
    real = speculative.speculative_generate

    def counting(*args, **kwargs):
        measured.append(kwargs["draft_policy"].name)
        return real(*args, **kwargs)

    monkeypatch.setattr("jaxspec.decoding.speculative.speculative_generate", counting)
    assert main(E2E + ["--out", str(out)]) == 0
    resumed = json.loads(out.read_text())["cases"]["ctx160/b2"]
    assert measured == ["magicdec", "draft-model"]  # magicdec, then streaming (a plain draft); not sd again
    assert resumed["complete"] is True and resumed["sd"] == data["cases"]["ctx160/b2"]["sd"]
    assert [r["method"] for r in resumed["rows"]] == ["ar", "sd", "magicdec", "streaming"]
    assert [r["before"] for r in resumed["ar"]["runs"]] == ["sd", "magicdec", "streaming"]
    assert resumed["streaming"]["agreement_with_ar"]["first_divergence"] is not None


@pytest.mark.slow
def test_pair_speed_sparse_draft_variants_end_to_end(tmp_path, one_load_per_model):
    """Dustin-H with the draft reading sinks + a window or the previous I_verify + a window: each runs from
    the shared prefill, records its draft view, and its round reads fewer bytes than full-KV Dustin-H. The
    target as its own draft over sinks + a window (no second model): MagicDec's self-draft verifies densely,
    so its greedy float32 output is AR's token for token; Dustin-H's self-draft verifies on I_verify."""
    out = tmp_path / "pair.json"
    argv = [a for a in E2E]
    argv[argv.index("--methods") + 1] = "dustin,dustin-kv-streaming,dustin-kv-verify-set,magicdec-self,dustin-self"
    assert main(argv + ["--out", str(out)]) == 0
    case = json.loads(out.read_text())["cases"]["ctx160/b2"]
    assert case["magicdec-self"]["agreement_with_ar"]["identical"]
    assert case["magicdec-self"]["description"]["verification"] == "dense"
    assert case["dustin-self"]["description"]["draft_srh"].startswith("the target's SRH")
    assert case["precompile"]["methods"] == argv[argv.index("--methods") + 1].split(",")
    assert [g["methods"] for g in case["precompile"]["groups"]] == [
        ["dustin", "dustin-kv-streaming", "dustin-kv-verify-set"], ["magicdec-self", "dustin-self"]]
    for method in ("dustin", "dustin-kv-streaming", "dustin-kv-verify-set", "magicdec-self", "dustin-self"):
        assert 1 <= case[method]["metrics"]["tau"] <= 5, method
        assert case[method]["description"]["method"] == method
    assert case["dustin"]["description"]["draft_kv"] == "full"
    assert case["dustin-kv-streaming"]["description"]["draft_kv"].startswith("streaming: 4 sinks + a ")
    assert case["dustin-kv-verify-set"]["description"]["draft_kv"].startswith("verify-set: the previous round's I_verify")
    # the streaming view reads 128 of the 160 positions; I_verify + the window covers them all here (bytes capped)
    assert case["dustin-kv-streaming"]["round_bytes"] < case["dustin"]["round_bytes"]
    assert case["dustin-kv-verify-set"]["round_bytes"] == case["dustin"]["round_bytes"]
    assert [r["method"] for r in case["rows"]] == ["ar", "dustin", "dustin-kv-streaming", "dustin-kv-verify-set",
                                                   "magicdec-self", "dustin-self"]



@pytest.mark.slow
def test_pair_speed_repeats_time_pairs_and_report_the_median(tmp_path, one_load_per_model):
    """--repeats 3: each method is timed in 3 (AR, method) pairs, every pair recorded with the measured choice's
    decision and whether it repeated the first pair's tokens, the speed-up the median pair's ratio, the tokens/s
    each side's median; the AR runs say which pair they belong to."""
    out = tmp_path / "pair.json"
    argv = [a for a in E2E]
    argv[argv.index("--methods") + 1] = "sd,magicdec"
    assert main(argv + ["--repeats", "3", "--arbitrate", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["repeats"] == 3
    case = data["cases"]["ctx160/b2"]
    for method in ("sd", "magicdec"):
        record = case[method]
        pairs = record["pairs"]
        assert len(pairs) == 3
        for p in pairs:
            assert p["speedup_vs_ar"] == pytest.approx(p["tok_s"] / p["paired_ar_tok_s"])
            assert p["choice"] in ("speculative", "ar")
        assert [p.get("same_tokens") for p in pairs] == [None, True, True]  # dense verification, float32
        assert record["speedup_vs_ar"] == pytest.approx(float(np.median([p["speedup_vs_ar"] for p in pairs])))
        assert record["tok_s"] == pytest.approx(float(np.median([p["tok_s"] for p in pairs])))
        assert record["paired_ar_tok_s"] == pytest.approx(float(np.median([p["paired_ar_tok_s"] for p in pairs])))
        assert record["row"]["speedup"] == record["speedup_vs_ar"]
        assert record["agreement_with_ar"]["identical"] is True  # dense verification, float32
    assert [(r["before"], r.get("repeat", 0)) for r in case["ar"]["runs"]] == [
        ("sd", 0), ("sd", 1), ("sd", 2), ("magicdec", 0), ("magicdec", 1), ("magicdec", 2)]
    # without --repeats the config does not name it (files measured before it existed still resume)
    assert "repeats" not in pair_speed.config_of(_args(), exclude=[k for k in pair_speed.OPTIONAL_CONFIG
                                                                   if not getattr(_args(), k)])


# ---------------------------------------------------------------------------- choice-table
def _pair_file(path, cases, model="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", experiment="pair-speed",
               **config):
    """A pair-speed results file with ``cases``: {(context, batch): {method: (speedup, paired AR tok/s)}}."""
    data = {"experiment": experiment, "config": {"model": model, "draft": draft, "dtype": "bfloat16", **config},
            "environment": {"devices": ["NVIDIA H200"]},
            "cases": {"copy_bandwidth": {"bandwidth_Bps": 3e12}}}
    for (context, batch), methods in cases.items():
        case = {"context": context, "batch": batch, "complete": True}
        for method, (speedup, ar_tok_s) in methods.items():
            case[method] = {"speedup_vs_ar": speedup, "paired_ar_tok_s": ar_tok_s, "tok_s": speedup * ar_tok_s}
        data["cases"][f"ctx{context}/b{batch}"] = case
    path.write_text(json.dumps(data))
    return str(path)


def test_choice_table_keeps_each_keys_lowest_speedup(tmp_path, capsys):
    """One entry per (method, context bucket, batch); where two runs measure a key the lower speed-up is kept and
    both are listed; the table's decisions follow its margin; the command writes what check_args then accepts."""
    a = _pair_file(tmp_path / "a.json", {(32000, 16): {"sd": (0.8, 3000.0), "dustin": (1.3, 3000.0)},
                                         (8000, 1): {"sd": (1.3, 400.0)}})
    b = _pair_file(tmp_path / "b.json", {(32000, 16): {"dustin": (1.1, 3100.0)}})
    table = choice_table.choice_table_from([a, b])
    rows = {(r["method"], r["context_bucket"], r["batch"]): r for r in table.rows()}
    assert set(rows) == {("sd", 32768, 16), ("dustin", 32768, 16), ("sd", 8192, 1)}
    dustin = rows[("dustin", 32768, 16)]
    assert dustin["speedup"] == 1.1 and len(dustin["measured"]) == 2 and dustin["choice"] == "speculative"
    assert dustin["ar_step_s"] == pytest.approx(16 / 3100.0)
    assert rows[("sd", 32768, 16)]["choice"] == "ar" and rows[("sd", 8192, 1)]["choice"] == "speculative"
    assert table.meta == {"target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b", "dtype": "bfloat16",
                          "device": "NVIDIA H200"}
    assert choice_table.choice_table_from([a, b], margin=0.2).rows()[0]["choice"] == "ar"  # dustin 1.1 < 1.2
    out = tmp_path / "choice.json"
    assert main(["choice-table", "--from", f"{a},{b}", "--out", str(out)]) == 0
    assert "3 entries" in capsys.readouterr().out
    assert pair_speed.check_args(_args("--arbitrate", "8", "--arbitrate-table", str(out)))[2] == ["sd", "magicdec"]
    for extra, message in [(["--arbitrate-table", str(out)], "give --arbitrate ROUNDS too"),
                           (["--arbitrate", "8", "--arbitrate-table", str(tmp_path / "none.json")], "no such file"),
                           (["--arbitrate", "8", "--arbitrate-table", str(out), "--draft", "smollm2-135m"],
                            "measured with draft 'qwen2.5-coder-0.5b', this run's draft is 'smollm2-135m'"),
                           (["--arbitrate", "8", "--arbitrate-tail", "8", "--arbitrate-table", str(out),
                             "--arbitrate-table-tail-after", "32", "--arbitrate-table-tail-margin", "1.5"],
                            "--arbitrate-table-tail-margin=1.5: a share in [0, 1)")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            pair_speed.check_args(_args(*extra))


def _with_events(path, events_of):
    """Give the methods of a _pair_file the arbitration events a run deciding from a table records."""
    data = json.loads(pathlib.Path(path).read_text())
    for key, case in data["cases"].items():
        for method, events in events_of.items():
            if isinstance(case, dict) and method in case:
                case[method]["metrics"] = {"arbitration": {"events": events}}
    pathlib.Path(path).write_text(json.dumps(data))
    return path


def test_choice_table_outcomes_take_back_a_decision_that_lost(tmp_path, capsys):
    """A run deciding from the table adds its whole-run speed-up to a key only where the table chose to
    speculate (a tail switch included); plain-decoding and probed decisions add nothing; the lowest still wins."""
    plain = _pair_file(tmp_path / "plain.json", {(32000, 8): {"magicdec": (1.06, 2300.0), "dustin": (1.06, 2300.0),
                                                              "sd": (0.9, 2300.0), "streaming": (1.3, 2300.0)}})
    table_spec = [{"choice": "speculative", "reason": "table", "table_speedup": 1.06}]
    chosen = _pair_file(tmp_path / "chosen.json",
                        {(32000, 8): {"magicdec": (0.58, 2310.0), "dustin": (1.19, 2310.0), "sd": (0.97, 2310.0),
                                      "streaming": (0.7, 2310.0)}},
                        arbitrate=8, arbitrate_table="table.json")
    _with_events(chosen, {"magicdec": table_spec + [{"choice": "ar", "reason": "tail", "after_rounds": 32}],
                          "dustin": table_spec,
                          "sd": [{"choice": "ar", "reason": "table", "table_speedup": 0.9}],
                          "streaming": [{"choice": "speculative", "reason": "probe"}]})
    table = choice_table.choice_table_from([plain], outcomes=[chosen])
    rows = {r["method"]: r for r in table.rows()}
    assert rows["magicdec"]["speedup"] == 0.58 and rows["magicdec"]["choice"] == "ar"
    outcome = [m for m in rows["magicdec"]["measured"] if m.get("outcome")]
    assert len(outcome) == 1 and outcome[0]["switched_to_ar"] is True
    assert rows["magicdec"]["ar_step_s"] == pytest.approx(8 / 2310.0)
    assert rows["dustin"]["speedup"] == 1.06 and len(rows["dustin"]["measured"]) == 2  # 1.19 joins, 1.06 stays
    assert rows["dustin"]["choice"] == "speculative"
    assert len(rows["sd"]["measured"]) == 1 and len(rows["streaming"]["measured"]) == 1  # AR / probed: no outcome
    assert choice_table.choice_table_from([plain]).rows()[1]["choice"] == "speculative"  # magicdec without outcomes
    out = tmp_path / "t.json"
    assert main(["choice-table", "--from", plain, "--outcomes", chosen, "--out", str(out)]) == 0
    assert "2 choose plain decoding" in capsys.readouterr().out
    with pytest.raises(ValueError, match="was not measured deciding from a choice table"):
        choice_table.choice_table_from([plain], outcomes=[plain])
    with pytest.raises(ValueError, match="runs deciding from a table go in --outcomes"):
        choice_table.choice_table_from([chosen])


def test_choice_table_from_probed_runs(tmp_path, capsys):
    """Runs under the measured choice without a table (--probed): each method's whole-run speed-up, its probe
    included, becomes its key's entry (a probe that chose AR lands below 1: the table then decides AR with no
    probe); it joins plain runs of the same key (the lowest wins); a table-deciding or plain file is refused there."""
    probe_ar = [{"choice": "ar", "probe": {"rounds": 8}}]
    probed = _pair_file(tmp_path / "probed.json",
                        {(32000, 8): {"magicdec": (0.95, 1790.0), "dustin": (0.94, 1790.0),
                                      "dustin-kv-streaming": (1.69, 1790.0)}}, arbitrate=8, arbitrate_tail=8)
    _with_events(probed, {"magicdec": probe_ar, "dustin": probe_ar,
                          "dustin-kv-streaming": [{"choice": "speculative", "probe": {"rounds": 8}}]})
    table = choice_table.choice_table_from([], probed=[probed])
    rows = {r["method"]: r for r in table.rows()}
    assert {m: r["choice"] for m, r in rows.items()} == {"magicdec": "ar", "dustin": "ar",
                                                         "dustin-kv-streaming": "speculative"}
    assert rows["magicdec"]["measured"][0]["probed"] is True and rows["magicdec"]["measured"][0]["probe_choice"] == "ar"
    assert rows["dustin"]["ar_step_s"] == pytest.approx(8 / 1790.0) and rows["dustin"]["context_bucket"] == 32768
    plain = _pair_file(tmp_path / "plain.json", {(32000, 8): {"dustin-kv-streaming": (1.5, 1800.0)}})
    both = {r["method"]: r for r in choice_table.choice_table_from([plain], probed=[probed]).rows()}
    assert both["dustin-kv-streaming"]["speedup"] == 1.5 and len(both["dustin-kv-streaming"]["measured"]) == 2
    out = tmp_path / "t.json"
    assert main(["choice-table", "--probed", probed, "--out", str(out)]) == 0
    assert "2 choose plain decoding" in capsys.readouterr().out
    assert pair_speed.check_args(_args("--arbitrate", "8", "--arbitrate-table", str(out)))[2] == ["sd", "magicdec"]
    chosen = _pair_file(tmp_path / "chosen.json", {(32000, 8): {"dustin": (1.1, 1790.0)}}, arbitrate=8,
                        arbitrate_table="t.json")
    for bad, message in ((plain, "give plain runs with --from"), (chosen, "runs deciding from a table go in "
                                                                           "--outcomes")):
        with pytest.raises(ValueError, match=message):
            choice_table.choice_table_from([], probed=[bad])
    with pytest.raises(ValueError, match="--from, or --probed"):
        choice_table.choice_table_from([])


def test_choice_table_refuses_mixed_or_unsuitable_files(tmp_path):
    good = _pair_file(tmp_path / "good.json", {(16000, 8): {"sd": (0.9, 3000.0)}})
    for name, kwargs, message in [("chosen", dict(arbitrate=8), "measured with --arbitrate"),
                                  ("reselect", dict(reselect_every=2), "measured with --reselect-every"),
                                  ("other", dict(model="smollm2-135m"), "has target 'smollm2-135m'"),
                                  ("speed", dict(experiment="dustin-speed"), "not a pair-speed or knapspec results file")]:
        bad = _pair_file(tmp_path / f"{name}.json", {(16000, 8): {"sd": (1.2, 3000.0)}}, **kwargs)
        with pytest.raises(ValueError, match=message):
            choice_table.choice_table_from([good, bad])
    empty = _pair_file(tmp_path / "empty.json", {})
    with pytest.raises(ValueError, match="no measured method"):
        choice_table.choice_table_from([empty])
    with pytest.raises(FileNotFoundError, match="no such file"):
        choice_table.choice_table_from([str(tmp_path / "none.json")])


def test_pair_memory_plan_counts_the_shared_prefill_and_one_runs_copy():
    """32k, batch 16 of the 1.5B / 0.5B shapes fits an 80 GB card (the prefilled caches plus one run's copy); batch
    32 is refused before any cache is allocated, naming the case; without a reported limit nothing is refused."""
    from jaxspec.config import preset

    from experiments.pair_speed import check_pair_memory

    target, draft = preset("qwen2.5-1.5b-shape"), preset("qwen2.5-0.5b-shape")
    (plan,) = check_pair_memory(target, draft, [(32000, 16, 32320)], True, 80 * 10**9)
    assert plan.total + plan.target_cache + plan.draft_cache < 80 * 10**9
    with pytest.raises(ValueError, match="context 32000, batch 32 .*does not fit"):
        check_pair_memory(target, draft, [(32000, 16, 32320), (32000, 32, 32320)], True, 80 * 10**9)
    assert len(check_pair_memory(target, draft, [(32000, 32, 32320)], True, None)) == 1
    (self_only,) = check_pair_memory(target, draft, [(32000, 16, 32320)], False, 80 * 10**9)
    assert self_only.draft_cache == 0


def test_tables_key_runs_by_the_bucket_they_started_in(tmp_path):
    """A run's context bucket is that of its committed length, the prompt plus the prefill's token, so a
    16,384-token prompt starts in bucket 32,768 and an 8,000-token one in 8,192; knapspec results become entries
    under those buckets, keyed by the case's method and batch."""
    from experiments.choice_table import knapspec_table_runs
    from jaxspec.decoding.arbitration import bucket_of, start_bucket

    assert [start_bucket(n) for n in (8000, 8191, 8192, 16384, 32000)] == [8192, 8192, 16384, 32768, 32768]
    assert bucket_of(0) == 1 and bucket_of(16384) == 16384
    case = {"method": "knapspec", "speedup_vs_ar": 0.9, "tokens_per_s": 9.0, "ar_tokens_per_s": 10.0}
    data = {"experiment": "knapspec", "config": {"model": "m", "dtype": "bfloat16"},
            "environment": {"devices": ["GPU"]},
            "cases": {"h100/summarize/ctx16384/b16/knapspec": case, "h100/summarize/ctx8000/b1/knapspec": case,
                      "h100/summarize/ctx8000/b1/dp_attention": {"rows": 2}, "latency_b1": "not a case"}}
    meta, runs = knapspec_table_runs(tmp_path / "k.json", data)
    assert meta == {"target": "m", "draft": "self", "dtype": "bfloat16", "device": "GPU"}
    assert sorted(key for key, _ in runs) == [("knapspec", 8192, 1), ("knapspec", 32768, 16)]
