"""Stage registry models onto a machine without registry access, in bounded transfers.

Some GPU and cluster nodes reach no package registry and receive files only in transfers of
bounded size. ``stage`` moves a registry model's GGUF there in chunks:

1. on a machine with registry access::

       python -m experiments.stage split qwen2.5-coder-1.5b qwen2.5-coder-0.5b --dir ~/jaxspec-transfer

   fetches each model (``jaxspec.models.registry``), cuts its file into chunks of at most
   ``--chunk-mib`` MiB (default 46: one chunk plus a source tree of up to ~18 MiB fits a 64 MiB
   transfer; size it as the transfer limit minus what else each transfer carries) and writes
   ``manifest.json`` (file name, size, sha256 of the file and of every chunk);
2. on the target machine, once per transfer, with whatever chunks this transfer carried::

       python -m experiments.stage receive --dir ~/jaxspec-transfer --stage-dir /tmp/jaxspec_stage

   verifies each carried chunk's sha256 and moves it into ``--stage-dir`` (a chunk already there
   and verified is skipped, so a transfer that is repeated or arrives twice costs nothing). When
   every chunk of a model is present it reassembles the file into the jaxspec cache folder,
   verifies the whole file's sha256 (the registry's own check) and, with ``--convert DTYPE``,
   loads it once so the converted fast-loading copy exists before the first timed run.

``pack`` groups the chunks of one or more split folders into one folder per transfer (``t00``,
``t01``, ...), each with one manifest covering every model, so each transfer carries exactly one folder
and ``receive --dir`` takes it as it is: the short last chunks share the first transfers, the rest
follow in the order given (send the model that converts longest first)::

       python -m experiments.stage pack ~/xfer/1.5b ~/xfer/0.5b --out ~/xfer/transfers --transfer-mib 46

``--convert DTYPE --background`` converts in a process of its own (it outlives the call that
started it), so one model can convert while the next one's chunks arrive; ``stage wait`` blocks
until no conversion is running (each holds a lock file with its pid in the cache folder; one left
by a process that died is removed and reported). ``status`` prints what is staged. The chunk files
carry no code: they are slices of the GGUF.
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
from typing import Dict, List, Optional

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


def pack(split_dirs: List[pathlib.Path], out_dir: pathlib.Path, transfer_mib: float) -> List[Dict]:
    """Group the chunks of ``split_dirs`` (folders written by :func:`split`) into transfers of at most
    ``transfer_mib`` MiB of chunks each: ``out_dir/tNN/`` holds one transfer's chunks (hard links where
    the file system allows, else copies) and a manifest of every model, and ``out_dir/transfers.json``
    lists the transfers. The chunks shorter than the split's chunk size (each model's last) are packed
    first, largest first, each into the first transfer with room; the others follow, as many to a transfer
    as fit, in the order of ``split_dirs`` and of their manifests. Returns the transfers (``name``,
    ``chunks``, ``bytes``)."""
    if transfer_mib <= 0:
        raise ValueError(f"--transfer-mib={transfer_mib}: must be > 0")
    if not split_dirs:
        raise ValueError("give at least one folder written by `stage split`")
    limit = int(transfer_mib * MIB)
    models: Dict[str, Dict] = {}
    chunks = []  # (folder, chunk entry), in order
    for folder in split_dirs:
        for name, entry in _load_manifest(folder)["models"].items():
            if name in models and models[name] != entry:
                raise ValueError(f"{folder}: model {name!r} is also in another folder with different chunks; "
                                 f"split each model once")
            if name in models:
                continue
            models[name] = entry
            for chunk in entry["chunks"]:
                if not (folder / chunk["name"]).is_file():
                    raise FileNotFoundError(f"{folder / chunk['name']} is missing: run `stage split` again")
                if chunk["size"] > limit:
                    raise ValueError(f"{chunk['name']} is {chunk['size'] / MIB:.1f} MiB, over --transfer-mib "
                                     f"{transfer_mib:g}: split again with --chunk-mib <= {transfer_mib:g}")
                chunks.append((folder, chunk))
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"--out {out_dir} is not empty: give a new folder (its transfers would mix with these)")
    full = max(c[1]["size"] for c in chunks)  # the split's chunk size; a model's last chunk is shorter
    short = sorted((c for c in chunks if c[1]["size"] < full), key=lambda c: -c[1]["size"])
    groups: List[List] = []
    for item in short:  # first fit, largest first
        for group in groups:
            if sum(c[1]["size"] for c in group) + item[1]["size"] <= limit:
                group.append(item)
                break
        else:
            groups.append([item])
    for item in (c for c in chunks if c[1]["size"] == full):  # in order, as many to a transfer as fit
        if groups and groups[-1][-1][1]["size"] == full and sum(c[1]["size"] for c in groups[-1]) + full <= limit:
            groups[-1].append(item)
        else:
            groups.append([item])
    manifest = json.dumps({"models": models}, indent=1) + "\n"
    transfers = []
    for number, group in enumerate(groups):
        folder = out_dir / f"t{number:02d}"
        folder.mkdir(parents=True)
        (folder / MANIFEST).write_text(manifest)
        for source, chunk in group:
            try:
                os.link(source / chunk["name"], folder / chunk["name"])
            except OSError:
                shutil.copyfile(source / chunk["name"], folder / chunk["name"])
        transfers.append({"name": folder.name, "chunks": [c["name"] for _, c in group],
                          "bytes": sum(c["size"] for _, c in group)})
    (out_dir / "transfers.json").write_text(json.dumps({"transfer_mib": transfer_mib, "transfers": transfers},
                                                       indent=1) + "\n")
    print(f"{len(chunks)} chunks of {len(models)} model(s) in {len(transfers)} transfers of <= {transfer_mib:g} MiB "
          f"in {out_dir}", file=sys.stderr)
    return transfers


def _load_manifest(transfer_dir: pathlib.Path) -> Dict:
    path = transfer_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: carry the manifest written by `stage split` with every transfer")
    return json.loads(path.read_text())


def receive(transfer_dir: pathlib.Path, stage_dir: pathlib.Path, convert: str = "",
            background: bool = False) -> Dict[str, str]:
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
    ready = [name for name, status in state.items() if status in ("in cache", "assembled, sha256 verified")]
    if convert:  # a model another process is converting now is left to it (no second conversion)
        for name in list(ready):
            pid = _lock_pid(_lock(name))
            if pid is not None and _alive(pid):
                ready.remove(name)
                state[name] += f"; already converting (pid {pid})"
    if convert and ready and background:
        pid = convert_in_background(ready, convert)
        for name in ready:
            state[name] += f"; converting to {convert} in the background (pid {pid}; `stage wait` waits for it)"
    elif convert:
        for name, seconds in convert_models(ready, convert).items():
            state[name] += f"; loaded as {convert} in {seconds:.1f} s"
    for name, status in state.items():
        print(f"{name}: {status}")
    return state


# ---------------------------------------------------------------------------- conversion and its lock files
def _lock(name: str) -> pathlib.Path:
    """``<cache>/.NAME.converting``: holds the pid of the process converting NAME."""
    from jaxspec.models.registry import cache_dir

    return cache_dir() / f".{name}.converting"


def _lock_pid(lock: pathlib.Path) -> Optional[int]:
    """The pid a lock file holds; None when it is gone or being written just now."""
    try:
        return int(lock.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def convert_models(names: List[str], dtype: str) -> Dict[str, float]:
    """Load each model once in ``dtype`` (writing its converted fast-loading copy), each under its lock
    file so that ``stage wait`` in another process can wait for it. Returns the seconds per model."""
    from jaxspec.models.loading import load_model

    seconds = {}
    for name in names:
        lock = _lock(name)
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.write_text(str(os.getpid()))
        try:
            start = time.perf_counter()
            load_model(name, dtype=dtype)
            seconds[name] = time.perf_counter() - start
        finally:
            if lock.is_file() and lock.read_text().strip() == str(os.getpid()):
                lock.unlink()
    return seconds


def convert_in_background(names: List[str], dtype: str) -> int:
    """``stage convert NAMES --dtype DTYPE`` detached from this process (it outlives it, e.g. a
    transfer's call), its log in ``<cache>/stage-convert.log``; the lock files carry its pid from the
    start, so a ``stage wait`` right after this returns already waits for it. Returns the pid."""
    import subprocess

    from jaxspec.models.registry import cache_dir

    log = open(cache_dir() / "stage-convert.log", "a")
    process = subprocess.Popen([sys.executable, "-m", "experiments.stage", "convert", *names, "--dtype", dtype],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True, cwd=pathlib.Path(__file__).resolve().parent.parent)
    for name in names:
        _lock(name).write_text(str(process.pid))
    return process.pid


def wait_for_conversions(timeout: float, poll: float = 1.0) -> List[str]:
    """Block while a model is being converted (a lock file whose process is alive); a lock left by a
    process that died is removed and reported. Returns what was waited for; raises ``TimeoutError``
    naming the models still converting after ``timeout`` seconds."""
    from jaxspec.models.registry import cache_dir

    start, waited = time.perf_counter(), set()
    while True:
        running = []
        for lock in sorted(cache_dir().glob(".*.converting")):
            name = lock.name[1:-len(".converting")]
            pid = _lock_pid(lock)
            if pid is None:
                continue  # removed or being written just now: look again next time
            if _alive(pid):
                running.append(name)
            else:
                lock.unlink(missing_ok=True)
                print(f"{name}: its conversion (pid {pid}) ended without finishing; convert it again", file=sys.stderr)
        waited.update(running)
        if not running:
            return sorted(waited)
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"still converting after {timeout:g} s: {', '.join(running)}")
        time.sleep(poll)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.stage", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("split", help="fetch registry models and cut them into chunks + manifest")
    sp.add_argument("names", nargs="+")
    sp.add_argument("--dir", required=True, type=pathlib.Path)
    sp.add_argument("--chunk-mib", type=float, default=46.0,
                    help="largest chunk in MiB: the transfer limit minus everything else a transfer carries "
                         "(default 46: a 64 MiB transfer with a source tree of up to ~18 MiB)")
    pk = sub.add_parser("pack", help="group split folders' chunks into one folder per transfer, each with a manifest")
    pk.add_argument("dirs", nargs="+", type=pathlib.Path, help="folders written by `stage split`, in sending order")
    pk.add_argument("--out", required=True, type=pathlib.Path, help="a new folder for the tNN transfer folders")
    pk.add_argument("--transfer-mib", type=float, default=46.0,
                    help="most MiB of chunks a transfer carries (default 46, the default chunk size)")
    rc = sub.add_parser("receive", help="take the carried chunks; reassemble and verify complete models")
    rc.add_argument("--dir", required=True, type=pathlib.Path, help="where this transfer's chunks and manifest are")
    rc.add_argument("--stage-dir", type=pathlib.Path, default=pathlib.Path("/tmp/jaxspec_stage"))
    rc.add_argument("--convert", default="", choices=["", "bfloat16", "float32"],
                    help="after assembling, load once in this dtype (writes the converted copy)")
    rc.add_argument("--background", action="store_true",
                    help="with --convert: convert in a process of its own and return at once (`stage wait` waits)")
    cv = sub.add_parser("convert", help="load staged models once in --dtype (the converted copy), under lock files")
    cv.add_argument("names", nargs="+")
    cv.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    wt = sub.add_parser("wait", help="wait until no staged model is being converted")
    wt.add_argument("--timeout", type=float, default=600.0, help="seconds; then exit 2 naming what still converts")
    st = sub.add_parser("status", help="what is staged (same as receive with no chunks carried)")
    st.add_argument("--dir", required=True, type=pathlib.Path)
    st.add_argument("--stage-dir", type=pathlib.Path, default=pathlib.Path("/tmp/jaxspec_stage"))
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            split(args.names, args.dir, args.chunk_mib)
        elif args.command == "pack":
            pack(args.dirs, args.out, args.transfer_mib)
        elif args.command == "convert":
            for name, seconds in convert_models(args.names, args.dtype).items():
                print(f"{name}: loaded as {args.dtype} in {seconds:.1f} s")
        elif args.command == "wait":
            waited = wait_for_conversions(args.timeout)
            print(f"converted: {', '.join(waited)}" if waited else "nothing was converting")
        else:
            if getattr(args, "background", False) and not args.convert:
                raise ValueError("--background applies to --convert: give --convert DTYPE too")
            receive(args.dir, args.stage_dir, getattr(args, "convert", ""), getattr(args, "background", False))
    except (ValueError, FileNotFoundError, OSError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
