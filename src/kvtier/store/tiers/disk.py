"""The disk tier: per-group slab files of fixed-size slots, header + checksum per slot.

Files, strides and the one-writer lock: `disk_files`; directory scans for the tools:
`disk_scan`. This module is the read and write paths.

Write then publish: the payload is written first, then the header, whose checksum covers the
payload (fsync="always": one fdatasync after both, so a write is durable when it returns);
`free` zeroes the header. A crash at any point
leaves each slot either with its old header (whose checksum no longer matches a half-written
payload: a counted miss), with no header (a plain miss), or complete. Nothing reads back valid
but wrong; fsync only decides what survives a power loss, not what a process kill can do.

Writes are buffered `pwrite`s straight from the caller's buffer (a memoryview of its tensor),
1 MiB at a time, each piece checksummed right after the kernel copied it (in C, GIL released,
where the extension is built). Reads take one of two paths, both verifying every byte before
they report success:
- resident (the common case: a cache re-read soon after it was written): each slab file is
  mapped read-only once (`mmap`, MAP_SHARED, the whole file, which is sized to its capacity at
  open). When `mincore` says every page of the slot is in the page cache, the payload is copied
  from the mapping into the caller's buffer and checksummed in the same pass by kvtier's C
  extension (`kvtier.store._xxcopy`: each 64-byte stripe is loaded once, stored and folded into the
  XXH3 accumulators), so a verified load costs what a plain copy costs. Without the extension,
  it copies `MAP_PIECE` pieces and checksums each right after it lands, while it is still in
  the CPU's L2 cache. No syscall per read either way. Only resident pages are
  read through the mapping, so a device read error cannot become a SIGBUS; they stay EIO errors
  on the other path.
- otherwise `os.preadv` of header + payload into the caller's buffer (one syscall), then one
  checksum pass. A read from the device is bound by the device, not by the checksum.
While a second core is free (`pipeline`, below), one helper thread per tier takes part: a
batch of payloads (`write_many`, which `Store.save` uses) is written on two lanes, this thread
and the helper, each payload written and checksummed by one of them, the lanes split by slab
file (buffered writes to one file serialize on its inode lock); and a cold read of at least two
`piece_bytes` lets the helper read the pieces while this thread checksums them.
Buffered I/O through the page cache: a cache is re-read soon after it is written, and O_DIRECT
would need aligned buffers the engine does not give us.
Mapped pages count in the process's RSS as shared file pages (`RssFile`): they are the page
cache, which the kernel reclaims under memory pressure like any other.

Files are sized sparse (`ftruncate`), so a slot's blocks are allocated when it is written; under
a learned share a tier is laid out for the most slots each group may get (base.SlotTier) and
`release` punches out the blocks of a pool that shrank, keeping the file's size (a mapping
never sees it shorter).

The slab files are only ever truncated by their writer at open (under the directory's lock,
below), and `kvtier check --fix` only zeroes headers, so a mapped slot never lies past the end
of its file. Truncating a slab file by hand while a process has it open is not supported.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.store.payload import (
    HEADER_BYTES,
    DEFAULT_CHECKSUM,
    ChunkHeader,
    Rejected,
    StreamingChecksum,
    as_bytes_view,
    copy_checksum,
    decode_header,
    pwrite_checksum,
    encode_header,
    mismatch,
    seal,
    sealed_with,
    span_not_held,
    unverifiable,
    verify,
)
from kvtier.store.integrity import NO_SECRET_FOR_MAC, Keyed, MacStream, integrity
from kvtier.store.tiers.base import SlotTier, TierLayout
from kvtier.store.tiers.disk_files import (
    DATA_OFFSET,
    PAD,
    ZERO_HEADER,
    Mapping,
    map_file,
    open_namespace_dir,
    open_reader_dir,
    open_slabs,
    pwrite_all,
    resident,
    scan_fd,
    unmap,
    slot_stride,
)

FSYNC_POLICIES = ("never", "always")
# Cold reads of at least 2 pieces may overlap their copy with their checksum on two threads (see
# DiskTier._read_rest_verified); smaller ones are one call on the caller's thread, no thread hop.
PIECE_BYTES = 1 << 20
# "always": `write_many` of >= 2 payloads of >= 1 piece runs on two lanes, and cold reads of
# >= 2 pieces use the helper; "never": one thread does everything; "auto": the helper only while
# the load average (which counts this process too) leaves half a core free (docs/store.md).
# Both module values are read at construction (`kvtier bench store --disk-pipeline` sets one).
PIPELINE_MODES = ("auto", "always", "never")
PIPELINE = "auto"
# resident reads copy and checksum this many bytes at a time: the piece is still in L2 when
# the checksum reads it
MAP_PIECE = 512 << 10
# saves write this many bytes at a time and checksum them right after (a multiple of the
# checksum's 1 KiB block; smaller pieces cost more syscalls)
WRITE_PIECE = 1 << 20
# False: every read takes the preadv path (the default for `mapped_reads`, read at construction;
# `kvtier bench store --disk-reads preadv` sets it)
MAPPED_READS = True
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def _load_fallocate():  # type: ignore[no-untyped-def]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _load_fallocate()


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give back the blocks of [offset, offset + length) of a file, keeping its size (the range
    reads as zeros); raises OSError where the file system cannot."""
    if _FALLOCATE is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available")
    if _FALLOCATE(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class DiskTier(SlotTier):
    name = "disk"
    persistent = True

    def __init__(
        self, root: str | os.PathLike[str], layout: TierLayout, namespace_id: str, *,
        fsync: str = "never", pipeline: str | None = None, piece_bytes: int | None = None,
        mapped_reads: bool | None = None, keyed: Keyed | None = None, reader: bool = False,
    ) -> None:
        """`reader=True`: read a directory another process writes (the vLLM scheduler's
        promotions, while the worker writes): no writer lock, no file created or sized, every
        write fails and `free` does nothing."""
        super().__init__(layout)
        if fsync not in FSYNC_POLICIES:
            raise ConfigError(f"disk fsync policy {fsync!r} unknown; use one of: {', '.join(FSYNC_POLICIES)}")
        pipeline = PIPELINE if pipeline is None else pipeline
        piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
        if pipeline not in PIPELINE_MODES:
            raise ConfigError(f"disk pipeline mode {pipeline!r} unknown; use one of: {', '.join(PIPELINE_MODES)}")
        if piece_bytes < 4096:
            raise ConfigError(f"disk piece_bytes {piece_bytes} is too small; use at least 4096 (default {PIECE_BYTES})")
        self.pipeline = pipeline
        self.mapped = MAPPED_READS if mapped_reads is None else bool(mapped_reads)
        self.piece_bytes = piece_bytes
        self._cores_free = pipeline == "always"
        self._cores_checked = -1.0
        self.helper_ios = 0  # payloads read or written with the helper thread (bench reports it)
        # one helper thread per tier, made at the first large payload, joined by close()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        if not re.fullmatch(r"[0-9a-f]{16}", namespace_id):
            raise ConfigError(f"namespace id {namespace_id!r} must be 16 hex digits (keys.Namespace.id)")
        self.fsync = fsync
        self.namespace_id = namespace_id
        self.root = Path(root)
        self.keyed = keyed  # a tenant secret: payloads are MACed and only verified MACs restore
        # held by every read, write and close: close() never closes a slab fd under a writer (the
        # number would be reused by the next open and the rest of a payload would land there)
        self._io = threading.RLock()
        self.closed = False
        self.dir = self.root / namespace_id
        self.strides = [slot_stride(b) for b in layout.slot_bytes]
        if reader:
            self._lock_fd, why = open_reader_dir(self.dir), "opened to read beside its writer"
        else:
            self._lock_fd, why = open_namespace_dir(self.dir)  # the directory fd holds the lock
        self.read_only = why is not None
        if why is not None:
            self.last_error = why
        try:
            self._fds = open_slabs(self._lock_fd, self.dir, layout, self.strides, self.read_only)
        except BaseException:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise
        self._maps: list[Mapping | None] = [
            map_file(fd) if self.mapped and fd is not None else None for fd in self._fds]
        self.mapped_reads = 0  # payloads read through the mapping (bench reports it)
        self.unpunched_releases = 0  # releases that could only zero headers (no hole punching)

    # -- contract ------------------------------------------------------------------------
    def write(self, group: int, slot: int, header: ChunkHeader, data: object) -> bool:
        with self._io:
            if self.closed:
                return self._failed_write(group, slot, "tier closed")
            return self._count_write(group, slot, header, self._write(group, slot, header, data))

    def write_many(self, items: Iterable[tuple[int, int, ChunkHeader, object]]) -> list[bool]:
        """Write several payloads; while a second core is free (`pipeline`), on two lanes: this
        thread writes one lane's payloads while the helper thread writes the other's, each
        payload written and checksummed as `write` does. Lanes are split by slab file where
        that balances them (`split_lanes`): buffered writes to one file serialize on its inode
        lock, so two files make two cores copy at once. Each payload keeps the write-then-publish
        rule on its own; the results and counters are those of the same writes one by one."""
        with self._io:
            if self.closed:
                return [self._failed_write(g, s, "tier closed") for g, s, _, _ in items]
            items = list(items)
            big = sum(1 for it in items if it[2].payload_bytes >= self.piece_bytes)
            if big < 2 or not self._use_helper():
                return [self.write(*it) for it in items]
            lane_a, lane_b = split_lanes([(it[0], it[2].payload_bytes) for it in items])
            run = lambda lane: [(k, self._write(*items[k])) for k in lane]  # noqa: E731
            fut = self._helper().submit(run, lane_b)
            self.helper_ios += len(lane_b)
            try:
                done = run(lane_a)
            finally:
                wait_all([fut])
            done += fut.result()
            results = [False] * len(items)
            for k, err in done:  # counted here, on this thread only
                g, s, h, _ = items[k]
                results[k] = self._count_write(g, s, h, err)
            return results

    def _count_write(self, group: int, slot: int, header: ChunkHeader, error: str | None) -> bool:
        if error is not None:
            return self._failed_write(group, slot, error)
        self.writes += 1
        self.bytes_written += header.payload_bytes
        return True

    def _write(self, group: int, slot: int, header: ChunkHeader, data: object) -> str | None:
        """Write then publish one payload; None, or why it failed (no counter is touched, so
        two threads may run this at once on different slots)."""
        n = header.payload_bytes
        self._check(group, slot, n)
        src = as_bytes_view(data)
        if len(src) != n:
            raise ValueError(f"data has {len(src)} bytes, header says {n}")
        fd = self._fds[group]
        if self.read_only or fd is None:
            return self.last_error or "read-only directory"
        off = slot * self.strides[group]
        try:
            sealed = self._write_then_hash(fd, header, src, off + DATA_OFFSET)
            if self.keyed is not None:
                sealed = self.keyed.sign(sealed, src)
            os.pwrite(fd, encode_header(sealed), off)  # publish: only after the whole payload
            if self.fsync == "always":
                # one flush, not one per write: until it returns, a power loss may persist the
                # header without the payload, which the checksum turns into a miss
                os.fdatasync(fd)
        except OSError as exc:
            try:  # best effort: never leave an old header over a half-new payload
                os.pwrite(fd, ZERO_HEADER, off)
            except OSError:
                pass
            return f"{exc.strerror} ({exc.errno})"
        return None

    def read(self, group: int, slot: int, header: ChunkHeader, out: object) -> bool:
        with self._io:
            if self.closed:
                self.misses += 1
                return False
            self._check(group, slot)
            self.reads += 1
            fd = self._fds[group]
            n = header.payload_bytes
            dst = as_bytes_view(out)[:n]
            if len(dst) < n:  # the caller's mistake, not the slot's: never drop a valid slot for it
                raise ConfigError(f"read buffer of {len(dst)} bytes is smaller than the payload's {n}; "
                                  "size read buffers from the plan's chunk bytes")
            if fd is None:
                self.misses += 1
                return False
            off = slot * self.strides[group]
            m = self._maps[group]
            mapped = (m is not None and off + DATA_OFFSET + n <= len(m[1])
                      and resident(m[2], off, DATA_OFFSET + n))
            if mapped:
                assert m is not None
                # copied out first: a writer in another process may change it while it is decoded
                stored = decode_header(bytes(m[1][off:off + HEADER_BYTES]))
                first = got = 0
            else:
                hbuf = bytearray(HEADER_BYTES)  # per call: reads from several threads stay independent
                # large payloads: header + the first piece now, the rest streamed by the helper thread
                first = n if n < 2 * self.piece_bytes or not self._use_helper() else self.piece_bytes
                try:
                    got = os.preadv(fd, [hbuf, PAD, dst[:first]], off)
                except OSError as exc:
                    return self._drop_corrupt(group, slot, f"read error: {exc.strerror}")
                if got == 0:
                    self.misses += 1
                    return False
                stored = decode_header(hbuf if got >= HEADER_BYTES else hbuf[:got])
            if isinstance(stored, Rejected):
                if stored.reason.startswith("empty slot"):
                    self.misses += 1
                    return False
                return self._drop_corrupt(group, slot, stored.reason)
            why = mismatch(stored, header)
            if span_not_held(why):  # valid for the blocks it holds: a miss, the slot stays
                self.misses += 1
                return False
            if why is None and not mapped and got < DATA_OFFSET + first:
                why = f"payload truncated: {max(0, got - DATA_OFFSET)} of {n} bytes"
            keyed = self.keyed
            if why is None and keyed is not None:
                # a keyed read checks the MAC alone, in the same pass as the copy: the MAC covers
                # the header and every byte, so the checksum would be a second pass over the
                # bytes that proves nothing more (integrity's docstring). A slot without a MAC
                # (or of a kind this build cannot check) is never this secret's: dropped unread.
                why = keyed.unverifiable(stored)
                if why is None:
                    if mapped:
                        assert m is not None
                        self.mapped_reads += 1
                        start = off + DATA_OFFSET
                        why = keyed.copy_check(stored, m[1][start:start + n], dst)
                    elif first == n:
                        why = keyed.check(stored, dst)
                    else:
                        why = self._read_rest_verified(fd, stored, dst, off, keyed.stream(stored))
            elif why is None:
                if mapped:
                    assert m is not None
                    why = self._copy_verified(m[1], off + DATA_OFFSET, stored, dst)
                elif first == n:
                    why = verify(stored, dst)
                else:
                    why = self._read_rest_verified(fd, stored, dst, off)
                if why is None and integrity(None, stored, dst) == NO_SECRET_FOR_MAC:
                    self.misses += 1  # another keyed writer's: a miss, the slot stays
                    return False
            if why is not None:
                return self._drop_corrupt(group, slot, why)
            self.bytes_read += n
            return True

    def _copy_verified(self, view: memoryview, start: int, stored: ChunkHeader, dst: memoryview) -> str | None:
        """Copy the payload at `view[start:]` into `dst` and checksum it; the reason it is bad, or
        None. With the C extension it is one pass (each 64-byte stripe is loaded once, stored and
        hashed); without it, piece by piece, each piece checksummed in `dst` right after it
        lands (still in L2)."""
        why = unverifiable(stored)
        if why is not None:
            return why
        self.mapped_reads += 1
        n = stored.payload_bytes
        value = copy_checksum(dst, view[start:start + n], stored.checksum_kind)
        if value is None:
            summer = StreamingChecksum(stored.checksum_kind)
            for a in range(0, n, MAP_PIECE):
                b = min(a + MAP_PIECE, n)
                dst[a:b] = view[start + a:start + b]
                summer.update(dst[a:b])
            value = summer.value()
        return None if value == stored.checksum else "payload checksum mismatch"

    # -- the helper thread: a second core for saves and cold loads ---------------------------
    # A cold load (preadv path) is one kernel copy plus one checksum pass, and a save is a
    # kernel copy plus a checksum; on one core neither beats copy / (copy + checksum) of plain
    # I/O. os.preadv, pwrite_xxh3 and StreamingChecksum.update release the GIL, so the helper
    # reads a cold payload's pieces while this thread checksums them, and `write_many` gives it
    # a lane of whole payloads. The rules are unchanged: every byte is verified before a load
    # reports success, and each payload's header is published only after its whole payload.
    def _use_helper(self) -> bool:
        if self.pipeline != "auto":
            return self.pipeline == "always"
        now = time.monotonic()
        if now - self._cores_checked >= 1.0:  # /proc/loadavg at most once a second
            self._cores_checked = now
            cores = len(os.sched_getaffinity(0))
            self._cores_free = cores >= 2 and cores - os.getloadavg()[0] >= 0.5
        return self._cores_free

    def _helper(self) -> ThreadPoolExecutor:
        # a forked child inherits the executor but not its thread: work submitted there would
        # wait forever, so a child makes its own
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-disk")
            self._pool_pid = os.getpid()
        return self._pool

    def _read_rest_verified(self, fd: int, stored: ChunkHeader, dst: memoryview, off: int,
                            mac: MacStream | None = None) -> str | None:
        """Read pieces 1.. of the payload (piece 0 is in `dst` already) on the helper thread while
        this thread checksums piece k as soon as it lands (or feeds it to `mac`, a keyed read's
        MAC, instead); the reason it is bad, or None."""
        why = None if mac is not None else unverifiable(stored)
        if why is not None:
            return why
        n, p = stored.payload_bytes, self.piece_bytes
        spans = [(a, min(a + p, n)) for a in range(p, n, p)]
        pool = self._helper()
        self.helper_ios += 1
        base = off + DATA_OFFSET
        futures: list[Future[int]] = [pool.submit(os.preadv, fd, [dst[a:b]], base + a) for a, b in spans]
        try:
            summer: MacStream | StreamingChecksum = mac or StreamingChecksum(stored.checksum_kind)
            summer.update(dst[:p])
            for (a, b), fut in zip(spans, futures):
                got = fut.result()
                if got < b - a:
                    return f"payload truncated: {a + got} of {n} bytes"
                summer.update(dst[a:b])
        except OSError as exc:
            return f"read error: {exc.strerror}"
        finally:
            wait_all(futures)  # never return while the helper still writes into the caller's buffer
        if isinstance(summer, MacStream):
            return summer.verdict()
        return None if summer.value() == stored.checksum else "payload checksum mismatch"

    def _write_then_hash(self, fd: int, header: ChunkHeader, src: memoryview, offset: int) -> ChunkHeader:
        """Write the payload in WRITE_PIECE pieces and checksum each piece right after the kernel
        has copied it, while it is still in the CPU's cache (a checksum of the whole payload
        first would read it from DRAM once more): one C call with the GIL released. Without the
        C extension: checksum, then one write. The sealed header; raises the write's OSError."""
        value = pwrite_checksum(fd, src, offset, WRITE_PIECE, DEFAULT_CHECKSUM)
        if value is None:
            sealed = seal(header, src)
            pwrite_all(fd, src, offset)
            return sealed
        return sealed_with(header, value, DEFAULT_CHECKSUM)

    def free(self, group: int, slot: int) -> None:
        with self._io:
            if self.closed:
                return
            self._check(group, slot)
            fd = self._fds[group]
            if fd is None or self.read_only:
                return
            try:
                os.pwrite(fd, ZERO_HEADER, slot * self.strides[group])
            except OSError:
                pass  # a slot we cannot zero still fails its header/checksum checks on read

    def header(self, group: int, slot: int) -> ChunkHeader | None:
        """`SlotTier.header`: one `pread` of the slot's header, decoded; nothing dropped or counted."""
        with self._io:
            self._check(group, slot)
            fd = self._fds[group]
            if self.closed or fd is None:
                return None
            try:
                h = decode_header(os.pread(fd, HEADER_BYTES, slot * self.strides[group]))
            except OSError:
                return None
            return h if isinstance(h, ChunkHeader) else None

    def move(self, group: int, src: int, dst: int, header: ChunkHeader) -> bool:
        """`SlotTier.move`: a verified `read` of `src` (checksum, or MAC when keyed; counted as
        any read), then `write` to `dst` with the header `src` had (`header` or a wider span of
        it: sealed and signed anew), then `free(src)`."""
        with self._io:
            self._check(group, src, header.payload_bytes)
            self._check(group, dst)
            if src == dst:
                raise ValueError(f"move of group {group} slot {src} onto itself")
            buf = bytearray(header.payload_bytes)
            stored: ChunkHeader | Rejected | None = None
            if self.read(group, src, header, buf):
                fd = self._fds[group]
                assert fd is not None  # a read hit has a file
                try:  # read just verified it: the header `src` has, under this tier's lock
                    stored = decode_header(os.pread(fd, HEADER_BYTES, src * self.strides[group]))
                except OSError as exc:
                    stored = Rejected(f"read error: {exc.strerror}")
                if isinstance(stored, Rejected):
                    self._drop_corrupt(group, src, stored.reason)
            ok = isinstance(stored, ChunkHeader) and self.write(group, dst, stored, buf)
            if not ok:
                self.free(group, dst)
            self.free(group, src)
            return ok

    def release(self, group: int, slots: int) -> int:
        """`SlotTier.release`: the group's file is hole-punched from slot `slots`'s offset to its
        end (`fallocate(PUNCH_HOLE | KEEP_SIZE)`: headers read as zeros; the size is kept, so a
        mapped read never faults past the end). Where the file system cannot punch, each slot's
        header is zeroed instead (counted in `unpunched_releases`, logged once a minute) and no
        block is given back. Returns the bytes of blocks given back (`st_blocks` before - after)."""
        with self._io:
            self._check_release(group, slots)
            fd = self._fds[group]
            n, stride = self.layout.num_slots[group], self.strides[group]
            if self.closed or fd is None or self.read_only or slots == n:
                return 0
            before = os.fstat(fd).st_blocks
            try:
                punch_hole(fd, slots * stride, (n - slots) * stride)
            except OSError as exc:
                self.unpunched_releases += 1
                self._warnings.warn("punch", f"tier disk: cannot punch holes in {self.dir} "
                                    f"({exc.strerror}); released slots have their headers zeroed, "
                                    "and their blocks stay allocated")
                written = -(-os.fstat(fd).st_size // stride)  # a zero header past the end would grow it
                for s in range(slots, min(n, written)):
                    self.free(group, s)
            if self.fsync == "always":
                try:
                    os.fdatasync(fd)
                except OSError:
                    pass
            return max(0, before - os.fstat(fd).st_blocks) * 512

    def allocated_bytes(self) -> int:
        """Disk blocks the slab files hold now (`st_blocks`): what the tier commits."""
        with self._io:
            return sum(os.fstat(fd).st_blocks * 512 for fd in self._fds if fd is not None)

    def list(self) -> Iterator[tuple[int, int, ChunkHeader]]:
        """Valid headers of this namespace in the current layout, oldest first.

        A slot whose header is bad (torn, flipped, newer format, another namespace or group)
        is dropped as it is found and counted in `corrupt_dropped`: a restart cleans up.
        """
        found: list[tuple[int, int, int, ChunkHeader]] = []
        for g, fd in enumerate(self._fds):
            if fd is None:
                continue
            for s, h in scan_fd(fd, self.strides[g], self.layout.num_slots[g]):
                if isinstance(h, Rejected):
                    why: str | None = h.reason
                elif h.namespace_id != self.namespace_id:
                    why = f"foreign namespace {h.namespace_id}"
                elif h.group != g:
                    why = f"group {h.group} in group {g}'s file"
                else:
                    why = None
                if why is not None:
                    self.corrupt_dropped += 1
                    self._warnings.warn("corrupt", f"tier disk: dropped group {g} slot {s} at scan: {why}")
                    self.free(g, s)
                    continue
                found.append((h.created_ns, g, s, h))
        found.sort(key=lambda t: (t[0], t[1], t[2]))
        for _, g, s, h in found:
            yield g, s, h

    def close(self) -> None:
        with self._io:
            for g, m in enumerate(self._maps):
                if m is not None:
                    unmap(m)
                    self._maps[g] = None
            if self._pool is not None and self._pool_pid == os.getpid():
                self._pool.shutdown(wait=True)  # no helper read or write outlives its file
                self._pool = None
            for fd in self._fds:
                if fd is not None:
                    os.close(fd)
            self._fds = [None] * len(self._fds)
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None
            self.closed = True  # every later read misses and every write fails, counted

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def split_lanes(items: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Two lanes (lists of indices into `items`, each (group, bytes), order kept) for
    `DiskTier.write_many`. Whole groups go to the lighter lane, largest group first, so the two
    lanes write different files; if that leaves one lane with more than 60% of the bytes (one
    group, or one dominant group), payloads are dealt one by one to the lighter lane instead."""
    total = sum(b for _, b in items) or 1
    per_group: dict[int, int] = {}
    for g, b in items:
        per_group[g] = per_group.get(g, 0) + b
    loads, side = [0, 0], {}
    for g in sorted(per_group, key=lambda g: (-per_group[g], g)):
        k = 0 if loads[0] <= loads[1] else 1
        side[g] = k
        loads[k] += per_group[g]
    if max(loads) <= 0.6 * total:
        lanes: tuple[list[int], list[int]] = ([], [])
        for i, (g, _) in enumerate(items):
            lanes[side[g]].append(i)
        return lanes
    lanes, loads = ([], []), [0, 0]
    for i, (_, b) in enumerate(items):
        k = 0 if loads[0] <= loads[1] else 1
        lanes[k].append(i)
        loads[k] += b
    return lanes


