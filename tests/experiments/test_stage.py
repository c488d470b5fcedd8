"""experiments.stage: chunked transfer of registry files onto a machine without registry access."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from experiments import stage
from jaxspec.models import registry


@pytest.fixture
def tiny_asset(tmp_path, monkeypatch):
    """A registry entry whose 'GGUF' is 10 kB of bytes in a source folder, and a fresh cache folder."""
    data = bytes(range(256)) * 40
    source = tmp_path / "source" / "tiny.gguf"
    source.parent.mkdir()
    source.write_bytes(data)
    asset = registry.ModelAsset(name="tiny", description="test", packages=("tiny==0",), kind="wheel_member",
                                member_glob="tiny.gguf", filename="tiny.gguf", size=len(data),
                                sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny", asset)
    monkeypatch.setattr(registry, "resolve_model_file", lambda name, **kw: source)
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    return data


def _transfer(split_dir, carry_dir, chunk):
    """One transfer: the manifest and one chunk, nothing else."""
    if carry_dir.exists():
        shutil.rmtree(carry_dir)
    carry_dir.mkdir()
    shutil.copy(split_dir / stage.MANIFEST, carry_dir)
    shutil.copy(split_dir / chunk, carry_dir)


def test_split_then_receive_chunk_by_chunk_reassembles_and_verifies(tiny_asset, tmp_path):
    split_dir, carry, staged = tmp_path / "split", tmp_path / "carry", tmp_path / "stage"
    manifest = stage.split(["tiny"], split_dir, chunk_mib=3000 / stage.MIB)
    chunks = [c["name"] for c in manifest["models"]["tiny"]["chunks"]]
    assert len(chunks) == 4 and sum(c["size"] for c in manifest["models"]["tiny"]["chunks"]) == len(tiny_asset)
    for number, chunk in enumerate(chunks[:-1], 1):
        _transfer(split_dir, carry, chunk)
        assert stage.receive(carry, staged) == {"tiny": f"{number}/4 chunks"}
    _transfer(split_dir, carry, chunks[1])  # a repeated transfer costs nothing and changes nothing
    assert stage.receive(carry, staged) == {"tiny": "3/4 chunks"}
    _transfer(split_dir, carry, chunks[-1])
    assert stage.receive(carry, staged) == {"tiny": "assembled, sha256 verified"}
    assert (registry.cache_dir() / "tiny.gguf").read_bytes() == tiny_asset
    assert not list(staged.iterdir())  # staged chunks are removed once the file is in the cache
    assert stage.receive(carry, staged) == {"tiny": "in cache"}


def test_a_chunk_damaged_in_transfer_is_refused(tiny_asset, tmp_path):
    split_dir, carry = tmp_path / "split", tmp_path / "carry"
    manifest = stage.split(["tiny"], split_dir, chunk_mib=5000 / stage.MIB)
    first = manifest["models"]["tiny"]["chunks"][0]["name"]
    _transfer(split_dir, carry, first)
    damaged = bytearray((carry / first).read_bytes())
    damaged[7] ^= 1
    (carry / first).write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="damaged in transfer"):
        stage.receive(carry, tmp_path / "stage")
    assert not (tmp_path / "stage" / first).exists()


def test_bad_input_is_named(tiny_asset, tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        stage.split(["no-such-model"], tmp_path / "split", chunk_mib=1)
    with pytest.raises(ValueError, match="chunk-mib"):
        stage.split(["tiny"], tmp_path / "split", chunk_mib=0)
    with pytest.raises(FileNotFoundError, match="manifest"):
        stage.receive(tmp_path / "empty", tmp_path / "stage")
    assert stage.main(["receive", "--dir", str(tmp_path / "empty")]) == 2


def test_manifest_records_every_chunk_digest(tiny_asset, tmp_path):
    stage.split(["tiny"], tmp_path / "split", chunk_mib=4096 / stage.MIB)
    manifest = json.loads((tmp_path / "split" / stage.MANIFEST).read_text())
    for chunk in manifest["models"]["tiny"]["chunks"]:
        data = (tmp_path / "split" / chunk["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == chunk["sha256"] and len(data) == chunk["size"]


def test_wait_blocks_on_a_live_conversion_and_clears_a_dead_ones_lock(tiny_asset, tmp_path, capsys):
    """`stage wait`: a lock whose process runs is waited for (and times out with the model named); a lock
    left by a process that is gone is removed and reported."""
    import subprocess
    import sys

    from jaxspec.models.registry import cache_dir

    cache_dir().mkdir(parents=True, exist_ok=True)
    assert stage.wait_for_conversions(timeout=1) == []
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stage._lock("tiny").write_text(str(sleeper.pid))
        with pytest.raises(TimeoutError, match="still converting after 0.3 s: tiny"):
            stage.wait_for_conversions(timeout=0.3, poll=0.1)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert stage.wait_for_conversions(timeout=5, poll=0.1) == []  # its process is gone: the lock is stale
    assert not stage._lock("tiny").exists()
    assert "tiny: its conversion (pid" in capsys.readouterr().err
    assert stage.main(["wait", "--timeout", "1"]) == 0


def test_convert_holds_its_lock_while_loading(tiny_asset, monkeypatch):
    """`stage convert` writes the lock with its pid before loading and removes it after, even on failure."""
    import os

    from jaxspec.models import loading

    seen = []

    def fake_load(name, dtype):
        seen.append((name, dtype, stage._lock(name).read_text()))
        if name == "bad":
            raise ValueError("cannot load")

    monkeypatch.setattr(loading, "load_model", fake_load)
    assert set(stage.convert_models(["tiny"], "bfloat16")) == {"tiny"}
    assert seen == [("tiny", "bfloat16", str(os.getpid()))] and not stage._lock("tiny").exists()
    with pytest.raises(ValueError, match="cannot load"):
        stage.convert_models(["bad"], "bfloat16")
    assert not stage._lock("bad").exists()


def test_background_needs_convert(tiny_asset, tmp_path, capsys):
    assert stage.main(["receive", "--dir", str(tmp_path), "--background"]) == 2
    assert "--background applies to --convert" in capsys.readouterr().err


def test_background_conversion_starts_under_its_lock_and_wait_returns(tiny_asset, tmp_path):
    """`receive --convert --background` returns at once, naming the pid of a process of its own that holds
    the lock from its start; `stage wait` then returns once it has ended (here it fails: the test asset is
    not a real GGUF), leaving no lock and a log."""
    split_dir, carry, staged = tmp_path / "split", tmp_path / "carry", tmp_path / "stage"
    stage.split(["tiny"], split_dir, chunk_mib=1.0)
    shutil.copytree(split_dir, carry)
    state = stage.receive(carry, staged, convert="bfloat16", background=True)
    assert "converting to bfloat16 in the background (pid" in state["tiny"]
    pid = int(state["tiny"].split("(pid ")[1].split(";")[0])
    lock = stage._lock("tiny")
    assert not lock.exists() or lock.read_text() == str(pid)
    stage.wait_for_conversions(timeout=120, poll=0.2)
    assert not lock.exists()
    assert (registry.cache_dir() / "stage-convert.log").is_file()


def test_receive_leaves_a_model_to_the_process_already_converting_it(tiny_asset, tmp_path, monkeypatch):
    """With several models in every transfer's manifest, a later `receive --convert` finds the first model
    in the cache while its conversion still runs: it starts no second one, and says so."""
    import subprocess
    import sys

    split_dir, carry, staged = tmp_path / "split", tmp_path / "carry", tmp_path / "stage"
    stage.split(["tiny"], split_dir, chunk_mib=1.0)
    shutil.copytree(split_dir, carry)
    assert stage.receive(carry, staged) == {"tiny": "assembled, sha256 verified"}
    started = []
    monkeypatch.setattr(stage, "convert_in_background", lambda names, dtype: started.append(names) or 1)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stage._lock("tiny").write_text(str(sleeper.pid))
        state = stage.receive(carry, staged, convert="bfloat16", background=True)
        assert state == {"tiny": f"in cache; already converting (pid {sleeper.pid})"} and started == []
    finally:
        sleeper.kill()
        sleeper.wait()
    state = stage.receive(carry, staged, convert="bfloat16", background=True)  # the lock is stale now
    assert started == [["tiny"]] and "converting to bfloat16 in the background (pid 1" in state["tiny"]


def test_pack_groups_chunks_into_transfers_each_receivable_alone(tiny_asset, tmp_path, monkeypatch):
    """Two models split apart, packed into transfers: the short last chunks share the first transfer, every
    transfer folder is received on its own, and both files reassemble."""
    other = bytes(range(255, -1, -1)) * 30
    source = tmp_path / "source" / "other.gguf"
    source.write_bytes(other)
    monkeypatch.setitem(registry.KNOWN_MODELS, "other", registry.ModelAsset(
        name="other", description="test", packages=("other==0",), kind="wheel_member", member_glob="other.gguf",
        filename="other.gguf", size=len(other), sha256=hashlib.sha256(other).hexdigest()))
    paths = {"tiny": tmp_path / "source" / "tiny.gguf", "other": source}
    monkeypatch.setattr(registry, "resolve_model_file", lambda name, **kw: paths[name])
    chunk = 3000 / stage.MIB
    stage.split(["tiny"], tmp_path / "a", chunk_mib=chunk)   # 3000 x 3 + 1240
    stage.split(["other"], tmp_path / "b", chunk_mib=chunk)  # 3000 x 2 + 1680
    transfers = stage.pack([tmp_path / "a", tmp_path / "b"], tmp_path / "out", transfer_mib=chunk)
    assert [t["bytes"] for t in transfers] == [1680 + 1240, 3000, 3000, 3000, 3000, 3000]
    assert transfers[0]["chunks"] == ["other.gguf.part002", "tiny.gguf.part003"]
    assert transfers[1]["chunks"] == ["tiny.gguf.part000"] and transfers[-1]["chunks"] == ["other.gguf.part001"]
    listed = json.loads((tmp_path / "out" / "transfers.json").read_text())["transfers"]
    assert [t["name"] for t in listed] == [f"t{i:02d}" for i in range(6)]
    staged = tmp_path / "stage"
    states = [stage.receive(tmp_path / "out" / t["name"], staged) for t in transfers]
    assert states[0] == {"tiny": "1/4 chunks", "other": "1/3 chunks"}
    assert states[-1] == {"tiny": "in cache", "other": "assembled, sha256 verified"}
    assert (registry.cache_dir() / "tiny.gguf").read_bytes() == tiny_asset
    assert (registry.cache_dir() / "other.gguf").read_bytes() == other
    wider = stage.pack([tmp_path / "a", tmp_path / "b"], tmp_path / "out2", transfer_mib=2 * chunk)
    assert [t["bytes"] for t in wider] == [2920, 6000, 6000, 3000]  # two full chunks a transfer, in order
    assert wider[2]["chunks"] == ["tiny.gguf.part002", "other.gguf.part000"]


def test_pack_refuses_bad_input_before_writing(tiny_asset, tmp_path, capsys):
    stage.split(["tiny"], tmp_path / "a", chunk_mib=3000 / stage.MIB)
    assert stage.main(["pack", str(tmp_path / "a"), "--out", str(tmp_path / "o"), "--transfer-mib", "0"]) == 2
    assert "--transfer-mib=0.0: must be > 0" in capsys.readouterr().err
    assert stage.main(["pack", str(tmp_path / "a"), "--out", str(tmp_path / "o"),
                       "--transfer-mib", str(2000 / stage.MIB)]) == 2
    assert "over --transfer-mib" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert stage.main(["pack", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "manifest.json not found" in capsys.readouterr().err
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("")
    assert stage.main(["pack", str(tmp_path / "a"), "--out", str(tmp_path / "o")]) == 2
    assert "is not empty" in capsys.readouterr().err
