"""The one tier factory (kvtier.store.tiers.factory): each option reaches its tier, and the cpu
tier's fault-in touches private unpinned slabs only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.cpu import CpuTier
from kvtier.store.tiers.disk import DiskTier
from kvtier.store.tiers.factory import TierOptions, make_tier
from kvtier.store.tiers.host_region import HostRegion

LAYOUT = TierLayout(slot_bytes=(4096, 8192), num_slots=(2, 3))
NS = "00112233aabbccdd"


def test_cpu_slabs_take_the_layout_and_are_unpinned_when_asked() -> None:
    tier = make_tier("cpu", LAYOUT, TierOptions(pin_memory=False))
    assert isinstance(tier, CpuTier) and not tier.pinned and tier.region is None
    assert [tuple(s.shape) for s in tier.slabs] == [(2, 4096), (3, 8192)]
    tier.close()


def test_fault_in_touches_private_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    touched = []
    real = torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: touched.append(t.shape) or real(t))
    make_tier("cpu", LAYOUT, TierOptions(pin_memory=False)).close()
    assert touched == []
    make_tier("cpu", LAYOUT, TierOptions(pin_memory=False, fault_in=True)).close()
    assert touched == [(2, 4096), (3, 8192)]


def test_a_region_is_used_and_not_touched_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    region = HostRegion.create(tmp_path, "eng", LAYOUT)
    touched = []
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: touched.append(t.shape) or t)
    tier = make_tier("cpu", LAYOUT, TierOptions(pin_memory=False, region=region, fault_in=True))
    assert tier.region is region and touched == []
    tier.close()


def test_disk_writer_and_reader(tmp_path: Path) -> None:
    writer = make_tier("disk", LAYOUT, TierOptions(namespace_id=NS, root=tmp_path, fsync="always"))
    assert isinstance(writer, DiskTier) and writer.fsync == "always" and not writer.read_only
    reader = make_tier("disk", LAYOUT, TierOptions(namespace_id=NS, root=tmp_path, reader=True))
    assert isinstance(reader, DiskTier) and reader.read_only
    reader.close()
    writer.close()


def test_redis_takes_url_namespace_and_password() -> None:
    pytest.importorskip("redis")
    from kvtier.store.tiers.redis import RedisTier

    tier = make_tier("redis", None, TierOptions(namespace_id=NS, redis_url="redis://127.0.0.1:1/0",
                                                redis_password="s3cret"))
    assert isinstance(tier, RedisTier) and tier.options.password == "s3cret"
    tier.close()


@pytest.mark.parametrize("name, options, words", [
    ("tape", TierOptions(), "unknown tier 'tape'"),
    ("disk", TierOptions(namespace_id=NS), "needs a directory"),
    ("redis", TierOptions(), "needs a url"),
])
def test_mistakes_say_what_is_missing(name: str, options: TierOptions, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        make_tier(name, LAYOUT, options)
