"""Median cost per MiB of reserving (posix_fallocate), filling page tables (MADV_POPULATE_WRITE)
and punching (fallocate PUNCH_HOLE) tmpfs pages in /dev/shm: 7 rounds of 256 MiB each, the first
printed apart (a cold allocation). Why the vLLM worker's host region does these on its keeper
thread, not in an engine step (docs/vllm.md, "The learned share")."""

import mmap
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from kvtier.store.tiers.disk import punch_hole  # noqa: E402

MIB = 1 << 20
N = 256 * MIB


def main() -> None:
    path = f"/dev/shm/kvt-bench-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, N)
        mm = mmap.mmap(fd, N)
        res: dict[str, list[float]] = {"fallocate": [], "populate": [], "punch": []}
        for _ in range(7):
            t = time.perf_counter()
            os.posix_fallocate(fd, 0, N)
            res["fallocate"].append(time.perf_counter() - t)
            t = time.perf_counter()
            mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), 0, N)
            res["populate"].append(time.perf_counter() - t)
            t = time.perf_counter()
            punch_hole(fd, 0, N)
            res["punch"].append(time.perf_counter() - t)
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    for k, v in res.items():
        ms = [x * 1000 / (N // MIB) for x in v]
        med = statistics.median(ms[1:])
        print(f"{k:10s} first {ms[0]:.3f}, then median {med:.3f} ms/MiB [{min(ms[1:]):.3f}-{max(ms[1:]):.3f}]; "
              f"256 MiB: {med * 256:.0f} ms")


if __name__ == "__main__":
    main()
