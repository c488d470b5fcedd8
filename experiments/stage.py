"""Stage registry models onto a machine without registry access, in bounded transfers.

Some GPU and cluster nodes reach no package registry and receive files only in transfers of
bounded size. ``stage`` moves a registry model's GGUF there in chunks:

1. on a machine with registry access::

       python -m experiments.stage split qwen2.5-coder-1.5b qwen2.5-coder-0.5b --dir ~/jaxspec-transfer

   fetches each model (``jaxspec.models.registry``), cuts its file into chunks of at most
   ``--chunk-mib`` MiB (default 56: one chunk plus a source tree of up to ~8 MiB fits a 64 MiB
   transfer; size it as the transfer limit minus what else each transfer carries) and writes
   ``manifest.json`` (file name, size, sha256 of the file and of every chunk);
2. on the target machine, once per transfer, with whatever chunks this transfer carried::

       python -m experiments.stage receive --dir ~/jaxspec-transfer --stage-dir /tmp/jaxspec_stage

   verifies each carried chunk's sha256 and moves it into ``--stage-dir`` (a chunk already there
   and verified is skipped, so a transfer that is repeated or arrives twice costs nothing). When
   every chunk of a model is present it reassembles the file into the jaxspec cache folder,
   verifies the whole file's sha256 (the registry's own check) and, with ``--convert DTYPE``,
   loads it once so the converted fast-loading copy exists before the first timed run.

``status`` prints what is staged. The chunk files carry no code: they are slices of the GGUF.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import time
from typing import Dict, List

MANIFEST = "manifest.json"
MIB = 1 << 20


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 * MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def chunk_name(filename: str, index: int) -> str:
    return f"{filename}.part{index:03d}"


def split(names: List[str], out_dir: pathlib.Path, chunk_mib: float) -> Dict:
    from jaxspec.models.registry import KNOWN_MODELS, resolve_model_file

    if chunk_mib <= 0:
        raise ValueError(f"--chunk-mib={chunk_mib}: must be > 0")
    unknown = [n for n in names if n not in KNOWN_MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; registry names: {sorted(KNOWN_MODELS)}")
    chunk_bytes = int(chunk_mib * MIB)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"models": {}}
    for name in names:
        source = resolve_model_file(name)
        asset = KNOWN_MODELS[name]
        chunks = []
        with open(source, "rb") as handle:
            index = 0
            while True:
                data = handle.read(chunk_bytes)
                if not data:
                    break
                part = out_dir / chunk_name(asset.filename, index)
                digest = hashlib.sha256(data).hexdigest()
                if not (part.exists() and part.stat().st_size == len(data) and sha256_of(part) == digest):
                    part.write_bytes(data)
                chunks.append({"name": part.name, "size": len(data), "sha256": digest})
                index += 1
        manifest["models"][name] = {"filename": asset.filename, "size": asset.size, "sha256": asset.sha256,
                                    "chunks": chunks}
        print(f"{name}: {len(chunks)} chunks of <= {chunk_mib:g} MiB in {out_dir}", file=sys.stderr)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _load_manifest(transfer_dir: pathlib.Path) -> Dict:
    path = transfer_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: carry the manifest written by `stage split` with every transfer")
    return json.loads(path.read_text())


def receive(transfer_dir: pathlib.Path, stage_dir: pathlib.Path, convert: str = "") -> Dict[str, str]:
    from jaxspec.models.registry import cache_dir

    manifest = _load_manifest(transfer_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, entry in manifest["models"].items():
        target = cache_dir() / entry["filename"]
        if target.is_file() and target.stat().st_size == entry["size"]:
            state[name] = "in cache"
            continue
        present = 0
        for chunk in entry["chunks"]:
            staged = stage_dir / chunk["name"]
            arrived = transfer_dir / chunk["name"]
            if staged.is_file() and staged.stat().st_size == chunk["size"]:
                present += 1
                continue
            if arrived.is_file():
                digest = sha256_of(arrived)
                if digest != chunk["sha256"]:
                    raise ValueError(f"{arrived}: sha256 {digest} != manifest {chunk['sha256']} (damaged in "
                                     "transfer, or left there by an earlier split with another chunk size: remove "
                                     "it and carry this split's chunk)")
                tmp = staged.with_suffix(".tmp")
                shutil.copyfile(arrived, tmp)
                os.replace(tmp, staged)
                present += 1
        total = len(entry["chunks"])
        if present < total:
            state[name] = f"{present}/{total} chunks"
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.staging")
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for chunk in entry["chunks"]:
                data = (stage_dir / chunk["name"]).read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != entry["sha256"]:
            partial.unlink()
            for chunk in entry["chunks"]:  # a staged chunk went bad: start this model again
                (stage_dir / chunk["name"]).unlink(missing_ok=True)
            raise ValueError(f"{name}: reassembled sha256 {digest.hexdigest()} != {entry['sha256']}; chunks removed")
        os.replace(partial, target)
        for chunk in entry["chunks"]:
            (stage_dir / chunk["name"]).unlink(missing_ok=True)
        state[name] = "assembled, sha256 verified"
    if convert:
        for name, status in state.items():
            if status in ("in cache", "assembled, sha256 verified"):
                from jaxspec.models.loading import load_model

                start = time.perf_counter()
                load_model(name, dtype=convert)
                state[name] += f"; loaded as {convert} in {time.perf_counter() - start:.1f} s"
    for name, status in state.items():
        print(f"{name}: {status}")
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.stage", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("split", help="fetch registry models and cut them into chunks + manifest")
    sp.add_argument("names", nargs="+")
    sp.add_argument("--dir", required=True, type=pathlib.Path)
    sp.add_argument("--chunk-mib", type=float, default=56.0)
    rc = sub.add_parser("receive", help="take the carried chunks; reassemble and verify complete models")
    rc.add_argument("--dir", required=True, type=pathlib.Path, help="where this transfer's chunks and manifest are")
    rc.add_argument("--stage-dir", type=pathlib.Path, default=pathlib.Path("/tmp/jaxspec_stage"))
    rc.add_argument("--convert", default="", choices=["", "bfloat16", "float32"],
                    help="after assembling, load once in this dtype (writes the converted copy)")
    st = sub.add_parser("status", help="what is staged (same as receive with no chunks carried)")
    st.add_argument("--dir", required=True, type=pathlib.Path)
    st.add_argument("--stage-dir", type=pathlib.Path, default=pathlib.Path("/tmp/jaxspec_stage"))
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            split(args.names, args.dir, args.chunk_mib)
        else:
            receive(args.dir, args.stage_dir, getattr(args, "convert", ""))
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
