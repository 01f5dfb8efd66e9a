"""The cpu tier's slabs when a host registration is given (the vLLM worker passes vLLM's own
host_register/host_unregister on a GPU): each slab is registered once, exactly the memory the
tier serves from, and unregistered once, at close or when the tier is collected unclosed; a
registration that fails leaves a working tier. Run here with registration functions that
record their calls (no GPU on this machine: PyTorch's pinned fallback is not reached)."""

from __future__ import annotations

import gc

from kvtier.store.payload import make_header
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.cpu import CpuTier

LAYOUT = TierLayout(slot_bytes=(64, 0, 32), num_slots=(4, 0, 8))


def _recorder(ok: bool = True):
    calls: list[tuple[str, int, int]] = []

    def register(ptr: int, nbytes: int) -> bool:
        calls.append(("register", ptr, nbytes))
        return ok

    def unregister(ptr: int) -> None:
        calls.append(("unregister", ptr, 0))

    return calls, (register, unregister)


def test_each_slab_is_registered_once_and_unregistered_once_at_close() -> None:
    calls, reg = _recorder()
    tier = CpuTier(LAYOUT, pin_memory=True, host_register=reg)
    slabs = {(t.data_ptr(), t.numel()) for t in tier.slabs if t.numel()}
    assert {(p, n) for kind, p, n in calls if kind == "register"} == slabs == {
        (tier.slabs[0].data_ptr(), 256), (tier.slabs[2].data_ptr(), 256)}
    h = make_header("0123456789abcdef", b"\x01" * 16, 0, 0, 16, 64, "uint8")
    assert tier.write(0, 1, h, bytes(range(64))) and tier.read(0, 1, h, out := bytearray(64))
    assert out == bytes(range(64))
    tier.close()
    tier.close()  # idempotent
    assert sorted(p for kind, p, _ in calls if kind == "unregister") == sorted(p for p, _ in slabs)


def test_a_tier_collected_unclosed_unregisters_its_slabs() -> None:
    calls, reg = _recorder()
    tier = CpuTier(LAYOUT, pin_memory=True, host_register=reg)
    ptrs = sorted(t.data_ptr() for t in tier.slabs if t.numel())
    del tier
    gc.collect()
    assert sorted(p for kind, p, _ in calls if kind == "unregister") == ptrs


def test_without_pinning_nothing_is_registered() -> None:
    calls, reg = _recorder()
    CpuTier(LAYOUT, pin_memory=False, host_register=reg).close()
    assert calls == []
