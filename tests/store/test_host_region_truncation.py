"""A host region whose file shrinks under its mappings (issue 28, item 8): another process of
this user truncates it; the processes that mapped it read misses and fail writes, never die of
SIGBUS. Each side runs in a process of its own, so a crash shows as its return code."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from test_host_region import LAYOUT, header, other_process

from kvtier.store.tiers.cpu import CpuTier
from kvtier.store.tiers.host_region import HostRegion


def test_a_truncated_region_is_a_miss_in_the_process_that_made_it(tmp_path: Path) -> None:
    """Another process of this user truncates the region file: every read of the tier is then a
    counted miss and every write a counted failed write, never SIGBUS; the process exits
    normally and removes its file."""
    proc = other_process(tmp_path, """
        import os
        region = HostRegion.create(os.environ["KVT_BASE"], "eng", LAYOUT)
        cpu = CpuTier(LAYOUT, pin_memory=False, region=region)
        cpu.write(0, 1, header(1), torch.full((4096,), 7, dtype=torch.uint8))
        gen = cpu.generation(0, 1)
        print(region.path, flush=True)
        sys.stdin.readline()  # the file is truncated now
        out = torch.zeros(4096, dtype=torch.uint8)
        print("holds", cpu.holds(0, 1, header(1)))
        print("read", cpu.read(0, 1, header(1), out), int(out.sum()))
        print("header", cpu.header(0, 1))
        print("list", list(cpu.list()))
        print("write", cpu.write(0, 2, header(2), torch.ones(4096, dtype=torch.uint8)))
        cpu.begin(0, 3).fill_(5)  # the worker's store: fill the row in place, then commit
        cpu.commit(0, 3, header(3))
        print("committed", cpu.holds(0, 3, header(3)))
        now = cpu.generation(0, 1)
        print("generation", now != gen and now % 2 == 1)
        cpu.free(0, 1)
        try:
            int(cpu.view(0, 1, 16).sum())
            print("view given")
        except RegionError as exc:
            print("view refused")
        print("counts", cpu.misses, cpu.failed_writes)
        # a caller that copies from the slabs directly (the vLLM worker's write-behind) reads
        # zeros once the loss was seen, never a page past the file's end
        print("direct", int(cpu.slabs[0].sum()), int(cpu.slabs[1].sum()), bytes(region.tables[0][:8]) == bytes(8))
    """, wait=False)
    path = Path(proc.stdout.readline().strip())
    assert path.exists(), proc.stderr.read()
    os.truncate(path, 4096)
    out, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 0, f"killed by signal {-proc.returncode}: {err}"
    lines = out.strip().splitlines()
    assert lines == ["holds False", "read False 0", "header None", "list []", "write False",
                     "committed False", "generation True", "view refused", "counts 3 2",
                     "direct 0 0 True"], out
    assert not path.exists() and not path.parent.exists()  # its exit removed what it made


def test_a_truncated_region_is_a_miss_in_the_process_that_attached_it(tmp_path: Path) -> None:
    """The scheduler's side: a region it mapped shrinks under it; its reads of the slot table
    are misses and its fill (the promotion's begin, copy, commit) goes nowhere, never SIGBUS."""
    region = HostRegion.create(tmp_path, "eng", LAYOUT)
    worker = CpuTier(LAYOUT, pin_memory=False, region=region)
    worker.write(0, 1, header(1), torch.full((4096,), 7, dtype=torch.uint8))
    fh = open(region.path, "r+b")  # noqa: SIM115 - another process of this user, holding the file
    proc = other_process(tmp_path, """
        import os
        cpu = CpuTier(LAYOUT, pin_memory=False, region=HostRegion.attach(os.environ["KVT_BASE"],
                                                                         os.environ["KVT_NAME"], LAYOUT))
        assert cpu.holds(0, 1, header(1))
        print("mapped", flush=True)
        sys.stdin.readline()  # the file is truncated now
        print("holds", cpu.holds(0, 1, header(1)), cpu.header(0, 1))
        cpu.begin(0, 2).copy_(torch.ones(4096, dtype=torch.uint8))
        cpu.commit(0, 2, header(2))
        print("filled", cpu.holds(0, 2, header(2)))
    """, wait=False, name=region.name)
    assert proc.stdout.readline().strip() == "mapped", proc.stderr.read()
    os.ftruncate(fh.fileno(), 0)
    fh.close()
    out, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 0, f"killed by signal {-proc.returncode}: {err}"
    assert out.strip().splitlines() == ["holds False None", "filled False"], out
    # (this process's own mapping is not touched again: the test above covers the creator)
