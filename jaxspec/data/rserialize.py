"""A small reader for R's XDR serialization and lazy-load databases (``.rdx``/``.rdb``).

Only what plain data needs is supported: ``NULL``, symbols, pairlists (attributes),
character, logical, integer, double and generic vectors (lists), and back references.
Code (closures, environments, bytecode) and ALTREP objects raise
:class:`RSerializationError`.

Conversion to Python:

* character vector -> ``list[str | None]`` (``NA`` is ``None``);
* logical vector -> ``list[bool | None]``; integer vector -> ``list[int | None]``;
  double vector -> ``list[float]``;
* a list with a ``names`` attribute -> ``dict``, otherwise ``list``;
* other attributes are dropped.

A lazy-load database is a ``.rdx`` index (the whole file zlib- or gzip-compressed,
holding a serialized list with ``variables``: name -> ``(offset, length)`` into the
``.rdb``, and ``compressed``) and the ``.rdb``, where each object is a 4-byte
big-endian uncompressed length followed by the compressed serialization (zlib when
``compressed`` is ``TRUE``; for 2 and 3 one type byte ``Z``/``2``/``X``/``0`` comes
first: zlib, bzip2, xz, none).

The format is described in R's ``src/main/serialize.c``.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import pathlib
import struct
import zlib
from typing import Any

__all__ = ["RSerializationError", "unserialize", "read_lazyload_index", "read_lazyload_object"]

# SEXP type codes (Rinternals.h) and serialization-only pseudo types (serialize.c).
_NILSXP, _SYMSXP, _LISTSXP = 0, 1, 2
_CHARSXP, _LGLSXP, _INTSXP, _REALSXP = 9, 10, 13, 14
_STRSXP, _VECSXP, _EXPRSXP = 16, 19, 20
_REFSXP, _NILVALUE_SXP = 255, 254
_EMPTYENV_SXP, _BASEENV_SXP, _GLOBALENV_SXP = 242, 241, 253
_ATTRLISTSXP = 239

_NA_INTEGER = -(2**31)
_UTF8_MASK, _LATIN1_MASK, _BYTES_MASK = 1 << 3, 1 << 2, 1 << 1


class RSerializationError(ValueError):
    """The bytes are not an R serialization this reader understands."""


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []

    def take(self, count: int) -> bytes:
        end = self.pos + count
        if count < 0 or end > len(self.data):
            raise RSerializationError(
                f"truncated R serialization: wanted {count} bytes at offset {self.pos}, "
                f"only {len(self.data) - self.pos} left"
            )
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        length = self.int()
        if length == -1:  # long vector: two more ints
            upper, lower = struct.unpack(">II", self.take(8))
            length = (upper << 32) | lower
        if length < 0:
            raise RSerializationError(f"negative vector length {length} at offset {self.pos}")
        return length

    def item(self) -> Any:
        flags = self.int()
        kind = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        levels = flags >> 12

        if kind == _NILVALUE_SXP:
            return None
        if kind in (_EMPTYENV_SXP, _BASEENV_SXP, _GLOBALENV_SXP):
            return None
        if kind == _REFSXP:
            index = flags >> 8
            if index == 0:
                index = self.int()
            if not 1 <= index <= len(self.refs):
                raise RSerializationError(f"bad back reference {index} ({len(self.refs)} known)")
            return self.refs[index - 1]
        if kind == _SYMSXP:
            name = self.item()  # a CHARSXP
            symbol = _Symbol(name if isinstance(name, str) else "")
            self.refs.append(symbol)
            return symbol
        if kind in (_LISTSXP, _ATTRLISTSXP):
            return self._pairlist(flags)
        if kind == _CHARSXP:
            size = self.int()
            if size == -1:
                return None  # NA_character_
            raw = self.take(size)
            if levels & _LATIN1_MASK:
                return raw.decode("latin-1")
            if levels & _BYTES_MASK:
                return raw.decode("utf-8", errors="surrogateescape")
            return raw.decode("utf-8")

        if kind == _LGLSXP:
            count = self.length()
            values = struct.unpack(f">{count}i", self.take(4 * count))
            value: Any = [None if v == _NA_INTEGER else bool(v) for v in values]
        elif kind == _INTSXP:
            count = self.length()
            values = struct.unpack(f">{count}i", self.take(4 * count))
            value = [None if v == _NA_INTEGER else v for v in values]
        elif kind == _REALSXP:
            count = self.length()
            value = list(struct.unpack(f">{count}d", self.take(8 * count)))
        elif kind == _STRSXP:
            count = self.length()
            value = [self.item() for _ in range(count)]
        elif kind in (_VECSXP, _EXPRSXP):
            count = self.length()
            value = [self.item() for _ in range(count)]
        else:
            raise RSerializationError(
                f"unsupported R object type {kind} at offset {self.pos - 4} "
                "(this reader handles plain data: vectors, lists, attributes)"
            )
        if has_tag:  # vectors carry no tag; keep the stream aligned anyway
            self.item()
        if has_attr:
            attributes = self.item()
            names = attributes.get("names") if isinstance(attributes, dict) else None
            if kind in (_VECSXP, _EXPRSXP) and isinstance(names, list) and len(names) == len(value):
                value = dict(zip(names, value))
        return value

    def _pairlist(self, flags: int) -> dict:
        """Read a pairlist (used for attributes) into ``{tag: value}``."""
        result: dict = {}
        while True:
            kind = flags & 0xFF
            if kind == _NILVALUE_SXP:
                return result
            if kind not in (_LISTSXP, _ATTRLISTSXP):
                raise RSerializationError(f"pairlist cell of type {kind} is not supported")
            if flags & (1 << 9):
                self.item()  # attributes of the cell itself
            tag = self.item() if flags & (1 << 10) else None
            value = self.item()
            key = tag.name if isinstance(tag, _Symbol) else str(len(result))
            result[key] = value
            flags = self.int()


class _Symbol:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<R symbol {self.name}>"


def unserialize(data: bytes) -> Any:
    """Convert one XDR (``X\\n``) R serialization to Python objects (see module doc)."""
    if data[:2] != b"X\n":
        raise RSerializationError(
            f"not an XDR R serialization (starts with {data[:2]!r}, expected b'X\\n'); "
            "ASCII and native-binary formats are not supported"
        )
    reader = _Reader(data)
    reader.pos = 2
    version = reader.int()
    reader.int()  # R version that wrote it
    reader.int()  # minimal R version to read it
    if version == 3:
        reader.take(reader.int())  # native encoding name
    elif version != 2:
        raise RSerializationError(f"unsupported serialization version {version}")
    return reader.item()


def read_lazyload_index(rdx_path: str | pathlib.Path) -> dict:
    """Read a lazy-load ``.rdx`` index: ``{"variables": {name: [offset, length]}, ...}``."""
    raw = pathlib.Path(rdx_path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        data = gzip.decompress(raw)
    else:  # R_decompress1 layout: 4-byte length + zlib stream
        data = zlib.decompress(raw[4:])
    index = unserialize(data)
    if not isinstance(index, dict) or "variables" not in index:
        raise RSerializationError(f"{rdx_path} is not a lazy-load index (no 'variables' entry)")
    return index


def read_lazyload_object(
    rdb_path: str | pathlib.Path, offset: int, length: int, compressed: Any = True
) -> Any:
    """Read and unserialize the object stored at ``offset``/``length`` in a ``.rdb`` file."""
    with open(rdb_path, "rb") as stream:
        stream.seek(offset)
        blob = stream.read(length)
    if len(blob) != length:
        raise RSerializationError(f"{rdb_path}: wanted {length} bytes at {offset}, got {len(blob)}")
    mode = compressed[0] if isinstance(compressed, list) else compressed
    if mode is False or mode == 0:  # stored as is, no length header
        return unserialize(blob)
    expected = struct.unpack(">I", blob[:4])[0]
    if mode is True or mode == 1:
        data = zlib.decompress(blob[4:])
    elif mode in (2, 3):
        tag, body = blob[4:5], blob[5:]
        if tag == b"Z":
            data = zlib.decompress(body)
        elif tag == b"2":
            data = bz2.decompress(body)
        elif tag == b"X":
            data = lzma.decompress(body)
        elif tag == b"0":
            data = body
        else:
            raise RSerializationError(f"{rdb_path}: unknown compression type byte {tag!r}")
    else:
        raise RSerializationError(f"{rdb_path}: unknown 'compressed' value {compressed!r}")
    if len(data) != expected:
        raise RSerializationError(
            f"{rdb_path}: object at {offset} decompressed to {len(data)} bytes, header says {expected}"
        )
    return unserialize(data)
