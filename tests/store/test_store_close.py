"""`Store.close()` racing a save in another thread: close waits for the save (store lock), and
afterwards the disk tier refuses I/O. Before, close() closed a slab fd under the writer; the next
open() in the process got the same fd number and the rest of the payload went into that file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from kvtier.core.geometry import Geometry, Group
from kvtier.core.keys import Namespace
from kvtier.core.plan import make_plan
from kvtier.store.store import Store

C = 256
GEOM = Geometry(groups=(Group("full", "full", num_layers=8, tokens_per_block=16,
                              bytes_per_token_per_layer=1024),), tokens_per_hash=16)
PLAN = make_plan(GEOM, chunk_tokens=C)
NS = Namespace("close-race", GEOM.fingerprint(), "bfloat16")
MARK = 0xAB


def test_close_never_lets_a_save_write_into_another_file(tmp_path: Path) -> None:
    chunk = PLAN.groups[0].chunk_bytes  # 2 MiB
    payload = torch.full((chunk,), MARK, dtype=torch.uint8)
    leaked = []
    for round_ in range(4):
        store = Store(PLAN, NS, disk_dir=tmp_path / f"d{round_}", disk_bytes=64 * chunk)
        started = threading.Event()

        def saver() -> None:
            started.set()
            for i in range(12):
                toks = [round_ * 1000 + i * 7 + j for j in range(C + 1)]
                store.save_tokens(toks, {(0, 0): payload})

        t = threading.Thread(target=saver)
        t.start()
        started.wait()
        store.close()
        victims = []  # files opened right after close: they would reuse a closed slab's fd number
        for k in range(8):
            fd = os.open(tmp_path / f"victim{round_}-{k}", os.O_RDWR | os.O_CREAT, 0o600)
            victims.append(fd)
        t.join()
        for k, fd in enumerate(victims):
            os.close(fd)
            data = (tmp_path / f"victim{round_}-{k}").read_bytes()
            if data:
                leaked.append((round_, k, len(data)))
        m = store.metrics()
        assert m is not None
    assert leaked == [], f"KV bytes written into unrelated files: {leaked}"


def test_a_closed_disk_tier_refuses_io(tmp_path: Path) -> None:
    store = Store(PLAN, NS, disk_dir=tmp_path, disk_bytes=8 * PLAN.groups[0].chunk_bytes)
    toks = list(range(C + 1))
    payload = torch.full((PLAN.groups[0].chunk_bytes,), 1, dtype=torch.uint8)
    assert store.save_tokens(toks, {(0, 0): payload}) == 1
    disk = store.slot_tiers["disk"]
    store.close()
    assert disk.closed
    out = torch.zeros_like(payload)
    header = store.header(store.hashes(toks)[0], 0, 0)
    assert disk.read(0, 0, header, out) is False and not out.any()
    assert disk.write(0, 1, header, payload) is False and disk.last_error == "tier closed"
