"""Property: whatever sequence of saves, loads, corruptions and restarts, a load never restores
bytes other than the ones saved for that (chunk, group), and it restores at most the hit."""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core.geometry import Geometry, Group
from kvtier.core.keys import Namespace
from kvtier.core.plan import make_plan
from kvtier.store.store import Store
from kvtier.store.tiers.disk_files import DATA_OFFSET, slot_stride
from kvtier.store.tiers.disk_scan import scan_dir

C = 16
GEOM = Geometry(
    groups=(
        Group("full", "full", num_layers=1, tokens_per_block=16, bytes_per_token_per_layer=32),
        Group("local", "sliding", num_layers=1, tokens_per_block=16, bytes_per_token_per_layer=16, window=20),
        Group("ssm", "state", num_layers=1, tokens_per_block=16, state_bytes_per_layer=300),
    ),
    tokens_per_hash=16,
)
PLAN = make_plan(GEOM, chunk_tokens=C)
NS = Namespace("prop", GEOM.fingerprint(), "bfloat16")
ROW = sum(gp.chunk_bytes for gp in PLAN.groups)
# prompts that share prefixes: prompt k = a common stem of k % 3 chunks + its own tail
PROMPTS = [[7] * (C * (k % 3)) + [100 + k] * (C * (1 + k % 4)) + [1] for k in range(6)]


def expected(chunk_hash: bytes, group: int) -> torch.Tensor:
    n = PLAN.groups[group].chunk_bytes
    raw = (chunk_hash + bytes([group])) * (n // 33 + 1)
    return torch.frombuffer(bytearray(raw[:n]), dtype=torch.uint8)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.integers(0, 5)),
        st.tuples(st.just("load"), st.integers(0, 5)),
        st.tuples(st.just("corrupt"), st.integers(0, 10_000)),
        st.tuples(st.just("restart"), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, placement=st.sampled_from(["hits", "every"]))
def test_loads_never_restore_wrong_bytes(ops: list[tuple[str, int]], placement: str) -> None:
    root = tempfile.mkdtemp(prefix="kvtier-prop-")
    # "hits" (the default) shares half of each tier to the full group: 2 rows give every group a slot
    cpu = ROW if placement == "every" else 2 * ROW
    make = lambda: Store(PLAN, NS, cpu_bytes=cpu, disk_dir=root, disk_bytes=6 * ROW,  # noqa: E731
                         placement=placement)
    s = make()
    try:
        for op, arg in ops:
            if op == "save":
                toks = PROMPTS[arg]
                hashes = s.hashes(toks)
                s.save(hashes, lambda g, i: expected(hashes[i], g), len(toks))
            elif op == "load":
                toks = PROMPTS[arg]
                hit = s.lookup_tokens(toks)
                assert hit.tokens <= len(toks) - 1 and hit.tokens % C == 0
                bufs = {(gp.index, i): torch.zeros(gp.chunk_bytes, dtype=torch.uint8)
                        for gp in PLAN.groups for i in range(len(toks) // C)}
                got = s.load(hit, bufs)
                assert 0 <= got <= hit.tokens
                for gp in PLAN.groups:
                    for i in PLAN.chunks_for_hit(gp.index, got):
                        assert torch.equal(bufs[(gp.index, i)], expected(hit.chunk_hashes[i], gp.index)), \
                            f"wrong bytes restored: group {gp.index} chunk {i}"
            elif op == "corrupt":
                recs = [r for r in scan_dir(root) if r.problem is None]
                if recs:
                    r = recs[arg % len(recs)]
                    off = r.slot * slot_stride(r.slot_bytes) + DATA_OFFSET + arg % r.slot_bytes  # the payload
                    with open(r.path, "r+b") as f:
                        f.seek(off)
                        b = f.read(1)
                        f.seek(off)
                        f.write(bytes([b[0] ^ (1 + arg % 255)]))
            else:
                s.close()
                s = make()
    finally:
        s.close()
        shutil.rmtree(root, ignore_errors=True)
