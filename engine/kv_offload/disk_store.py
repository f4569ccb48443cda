"""The prefix cache's disk tier: whole KV blocks addressed by their chained block hash, one
file each under `<directory>/<key>/` where the key names the model, dtype and cache layout
(blocks of another model or layout are never even looked at).

Writes go through one background thread (a step never waits for the disk): each to a
temporary name, then renamed, so a reader (this engine or another sharing the directory)
sees a whole file or none; a full queue drops the block rather than wait. A file holds a
header (magic, payload length, CRC-32 of the payload) and the payload; a short, corrupt or
foreign file is a miss and is deleted. The tier holds at most `capacity_bytes`, least
recently used out first; a full disk logs one warning and serving goes on without it."""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"LOOMKV01"
HEADER = struct.Struct("<8sQI")  # magic, payload bytes, crc32
SUFFIX = ".kv"
TEMPORARY = ".tmp-"


@dataclass(slots=True)
class DiskTierStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # files found broken (and deleted)
    dropped: int = 0  # blocks not written: queue full or disk full
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0


class DiskKVStore:
    def __init__(self, directory: Path | str, key: str, capacity_bytes: int,
                 max_pending: int = 256) -> None:
        self.directory = Path(directory) / key
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.stats = DiskTierStats()
        self._lock = threading.Lock()  # the index, shared with the writer thread
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._bytes = 0
        self._disk_full_logged = False
        self._scan()
        self._pending: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(max_pending)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: bytes) -> bool:
        """Indexed here, or written by another engine sharing the directory (a stat)."""
        return self.indexed(block_hash) or self._path(block_hash).is_file()

    def indexed(self, block_hash: bytes) -> bool:
        """Known to be on disk without asking the disk."""
        return block_hash in self._index

    def put(self, block_hash: bytes, payload: bytes) -> None:
        """Queues the block for writing (dropped when the writer is that far behind); the
        writer skips one another engine wrote meanwhile."""
        if self.indexed(block_hash):
            return
        try:
            self._pending.put_nowait((block_hash, payload))
        except queue.Full:
            self.stats.dropped += 1

    def get(self, block_hash: bytes) -> bytes | None:
        """The block's payload, or None: absent, or broken (then deleted)."""
        path = self._path(block_hash)
        started = time.perf_counter()
        try:
            data = path.read_bytes()
        except OSError:
            self.stats.misses += 1
            self._forget(block_hash)
            return None
        payload = _payload(data)
        if payload is None:
            self.stats.corrupt += 1
            self.stats.misses += 1
            self._remove(block_hash)
            return None
        with self._lock:
            if block_hash not in self._index:  # another engine wrote it
                self._index[block_hash] = len(data)
                self._bytes += len(data)
            self._index.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        self.stats.read_seconds += time.perf_counter() - started
        return payload

    def flush(self) -> None:
        """Waits until every queued block is written (tests, shutdown)."""
        self._pending.join()

    def close(self) -> None:
        self._pending.put(None)
        self._writer.join(timeout=10)

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    def _scan(self) -> None:
        """Index what an earlier run left, oldest first; the temporary files of a writer
        that is gone are debris of a write that never finished (those of a live engine
        sharing the directory are its writes in flight)."""
        entries = []
        for path in self.directory.iterdir():
            if path.name.startswith(TEMPORARY):
                if not _writer_alive(path.name):
                    path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                try:
                    stat = path.stat()
                    entries.append((stat.st_mtime, bytes.fromhex(path.name[:-len(SUFFIX)]),
                                    stat.st_size))
                except (OSError, ValueError):
                    continue
        for _, block_hash, size in sorted(entries):
            self._index[block_hash] = size
            self._bytes += size

    def _write_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._pending.task_done()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        if self._path(block_hash).is_file():  # another engine's: index it on a hit
            return
        started = time.perf_counter()
        data = HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload
        temporary = self.directory / f"{TEMPORARY}{os.getpid()}-{block_hash.hex()}"
        try:
            temporary.write_bytes(data)
            os.replace(temporary, self._path(block_hash))
        except OSError as error:
            temporary.unlink(missing_ok=True)
            self.stats.dropped += 1
            if not self._disk_full_logged:
                self._disk_full_logged = True
                logger.warning("KV disk tier: cannot write %s (%s); serving goes on without "
                               "the blocks it cannot write", self.directory, error)
            return
        with self._lock:
            self._index[block_hash] = len(data)
            self._bytes += len(data)
            evicted = self._evict()
        for old in evicted:
            self._path(old).unlink(missing_ok=True)
        self.stats.bytes_written += len(data)
        self.stats.write_seconds += time.perf_counter() - started

    def _evict(self) -> list[bytes]:
        evicted = []
        while self._bytes > self.capacity_bytes and self._index:
            block_hash, size = self._index.popitem(last=False)
            self._bytes -= size
            evicted.append(block_hash)
        return evicted

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._bytes -= size

    def _remove(self, block_hash: bytes) -> None:
        self._forget(block_hash)
        self._path(block_hash).unlink(missing_ok=True)


def _writer_alive(temporary_name: str) -> bool:
    """Is the process that names this temporary file (`.tmp-<pid>-<hash>`) still running?"""
    try:
        pid = int(temporary_name[len(TEMPORARY):].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process
        return True
    return pid != os.getpid()


def _payload(data: bytes) -> bytes | None:
    if len(data) < HEADER.size:
        return None
    magic, length, checksum = HEADER.unpack_from(data)
    payload = data[HEADER.size:]
    if magic != MAGIC or length != len(payload) or zlib.crc32(payload) != checksum:
        return None
    return payload
