"""The prefix cache's disk tier, pure Python: round trips, atomic files, broken files as
misses, the byte bound, sharing a directory, and a full disk."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kv_offload.disk_store import TEMPORARY, DiskKVStore


def block(index: int) -> tuple[bytes, bytes]:
    return bytes([index]) * 16, bytes([index % 251]) * (1000 + index)


@pytest.fixture
def store(tmp_path: Path):
    opened = DiskKVStore(tmp_path, "model-a", capacity_bytes=1 << 20)
    yield opened
    opened.close()


def test_a_block_written_is_read_back_and_survives_a_restart(tmp_path: Path, store) -> None:
    block_hash, payload = block(1)
    store.put(block_hash, payload)
    store.flush()
    assert store.get(block_hash) == payload
    store.close()
    again = DiskKVStore(tmp_path, "model-a", capacity_bytes=1 << 20)
    assert block_hash in again and again.get(block_hash) == payload
    assert DiskKVStore(tmp_path, "model-b", 1 << 20).get(block_hash) is None  # another key
    again.close()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "foreign"])
def test_a_broken_file_is_a_miss_and_is_deleted(store, damage: str) -> None:
    block_hash, payload = block(2)
    store.put(block_hash, payload)
    store.flush()
    path = store.directory / (block_hash.hex() + ".kv")
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:-10], "flipped": data[:-1] + b"\x00",
                      "empty": b"", "foreign": b"GGUF" + data[4:]}[damage])
    assert store.get(block_hash) is None
    assert not path.exists() and block_hash not in store
    assert store.stats.corrupt == 1


def test_the_least_recently_used_blocks_leave_beyond_the_byte_bound(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, "model-a", capacity_bytes=3500)
    for index in range(3):
        store.put(*block(index))
        store.flush()
    assert store.get(block(0)[0]) is not None  # block 0 is now the most recent
    store.put(*block(3))
    store.flush()
    assert store.num_bytes <= 3500
    assert block(1)[0] not in store and block(0)[0] in store and block(3)[0] in store
    store.close()


def test_engines_sharing_a_directory_read_each_others_whole_files(tmp_path: Path) -> None:
    first = DiskKVStore(tmp_path, "model-a", 1 << 20)
    second = DiskKVStore(tmp_path, "model-a", 1 << 20)
    block_hash, payload = block(5)
    first.put(block_hash, payload)
    first.flush()
    assert second.get(block_hash) == payload
    first.close()
    second.close()


def exited_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_debris_of_an_unfinished_write_never_loads(tmp_path: Path) -> None:
    directory = tmp_path / "model-a"
    directory.mkdir()
    block_hash, payload = block(6)
    (directory / f"{TEMPORARY}{exited_pid()}-{block_hash.hex()}").write_bytes(payload[:100])
    store = DiskKVStore(tmp_path, "model-a", 1 << 20)
    assert block_hash not in store and store.get(block_hash) is None
    assert list(directory.iterdir()) == []
    store.close()


def test_a_store_starting_beside_a_live_writer_leaves_its_write_in_flight(tmp_path: Path,
                                                                           ) -> None:
    """Engines sharing a directory: one restarting must not delete the other's temporary
    file mid-write (its rename would fail and drop the block)."""
    directory = tmp_path / "model-a"
    directory.mkdir()
    block_hash, payload = block(7)
    in_flight = directory / f"{TEMPORARY}{os.getppid()}-{block_hash.hex()}"
    in_flight.write_bytes(payload[:100])
    store = DiskKVStore(tmp_path, "model-a", 1 << 20)
    assert in_flight.exists() and block_hash not in store
    store.close()


def test_a_full_disk_logs_once_and_drops_the_blocks(store, monkeypatch, caplog) -> None:
    def no_space(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", no_space)
    with caplog.at_level(logging.WARNING):
        for index in range(3):
            store.put(*block(index))
        store.flush()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert len(caplog.records) == 1 and "cannot write" in caplog.records[0].message
    assert store.stats.dropped == 3 and len(store) == 0
    monkeypatch.undo()
    store.put(*block(4))
    store.flush()
    assert store.get(block(4)[0]) == block(4)[1]
