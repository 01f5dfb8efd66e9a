"""The disk tier's event journal (integrations/vllm/events.py `DiskJournal`) and a durable reset
(rebuild.py `mark_reset`, manager.py, connector.py): the journal runs inside vLLM's engine step,
so it never raises, stays bounded and is read back defensively; a reset's events survive vLLM's
reset raising, and the reset is marked again once its in-flight jobs are flushed."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (  # noqa: E402
    OffloadingEventGroupSpec, OffloadingEventsTracker, _OffloadEventMetadata)
from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, ReqContext, make_offload_key  # noqa: E402

from kvtier.core.geometry import Geometry, Group  # noqa: E402
from kvtier.core.keys import Namespace  # noqa: E402
from kvtier.core.plan import make_plan  # noqa: E402
from kvtier.integrations.vllm import events as events_mod  # noqa: E402
from kvtier.integrations.vllm import rebuild  # noqa: E402
from kvtier.integrations.vllm.common import SpecContext  # noqa: E402
from kvtier.integrations.vllm.config import parse_config  # noqa: E402
from kvtier.integrations.vllm.connector import KvtierConnector  # noqa: E402
from kvtier.integrations.vllm.counters import Metrics  # noqa: E402
from kvtier.integrations.vllm.events import DiskJournal, SelfDescribing, _frame  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierManager  # noqa: E402

TOKENS = 16
CHUNK = TOKENS * 64


def _manager(tmp_path: Path, **tier_bytes: int) -> KvtierManager:
    gs = (Group(name="g0", kind="full", num_layers=1, tokens_per_block=TOKENS, bytes_per_token_per_layer=64,
                dtype="float16", layers=(0,)),)
    geometry = Geometry(groups=gs, tokens_per_hash=TOKENS, name="journal")
    tier_bytes = tier_bytes or {"cpu": 4 * CHUNK, "disk": 8 * CHUNK}
    extra = {"kvtier.tiers": ",".join(tier_bytes), "kvtier.host_region": "off", "kvtier.directory": str(tmp_path)}
    extra.update({f"kvtier.{t}_bytes": n for t, n in tier_bytes.items()})
    ctx = SpecContext(plan=make_plan(geometry, blocks_per_chunk=1), namespace=Namespace("m", geometry.fingerprint(), "float16"),
                      config=parse_config(extra), group_of={0: 0}, blocks_per_chunk=1)
    return KvtierManager(ctx, Metrics("scheduler", None), events=True)


def _k(i: int):  # noqa: ANN202
    return make_offload_key(bytes([i]) * 32, 0)


def _tracker(journal: DiskJournal | None, n: int) -> tuple[SelfDescribing, list]:
    t = OffloadingEventsTracker(SimpleNamespace(enable_kv_cache_events=True, self_describing_kv_events=True))
    t.__class__ = SelfDescribing
    t.kvtier_journal = journal
    keys = [_k(i) for i in range(n)]
    for i, k in enumerate(keys):
        t._pending_event_metadata[k] = _OffloadEventMetadata(
            block_hashes=(bytes([i]) * 32,), parent_block_hash=None, token_ids=tuple(range(TOKENS)), block_size=TOKENS,
            lora_id=None, lora_name=None, extra_keys=None, group_idx=0,
            kv_cache_spec=OffloadingEventGroupSpec("full_attention", None), active_residencies=set())
    return t, keys


def _disk_stored(keys: list) -> list[OffloadingEvent]:
    return [OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=False, locality=Locality.LOCAL,
                            ownership="kvtier-disk")]


def _digest(evs) -> list:  # noqa: ANN001
    return [(type(e).__name__, tuple(getattr(e, "block_hashes", ()) or ())) for e in evs]


def test_a_journal_that_cannot_write_leaves_the_engine_step_and_its_events_intact(tmp_path: Path, monkeypatch) -> None:
    plain, keys = _tracker(None, 3)
    expected = _digest(plain.take_events(_disk_stored(keys)))
    journal = DiskJournal(tmp_path)
    t, keys = _tracker(journal, 3)

    def full(fd, data):  # noqa: ANN001, ANN202 - the kernel's answer on a full file system
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    got = _digest(t.take_events(_disk_stored(keys)))  # raised ENOSPC into vLLM's step before
    assert got == expected and got
    assert not journal.enabled and journal.errors == 1
    monkeypatch.undo()
    assert _digest(t.take_events(_disk_stored(keys))) == expected  # journal off: events go on


def test_the_journal_is_compacted_to_its_live_records(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(DiskJournal, "COMPACT_MIN", 4096)
    journal = DiskJournal(tmp_path)
    t, keys = _tracker(journal, 4)
    for _ in range(200):  # the same chunks stored and removed again and again
        t.take_events(_disk_stored(keys))
        t.take_events([OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=True,
                                       locality=Locality.LOCAL, ownership="kvtier-disk")])
        t._pending_event_metadata.update(_tracker(None, 4)[0]._pending_event_metadata)
    t.take_events(_disk_stored(keys))
    assert journal.enabled
    size = journal.path.stat().st_size
    assert size <= 2 * 4096  # appended without bound before (~200 x 8 records)
    assert sorted(journal.load()) == sorted(bytes(k) for k in keys)
    assert journal.path.stat().st_mode & 0o777 == 0o600


def test_a_journal_past_its_cap_stops_journaling(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(DiskJournal, "MAX_BYTES", 1024)
    journal = DiskJournal(tmp_path)
    t, keys = _tracker(journal, 40)  # live records alone pass the cap
    assert t.take_events(_disk_stored(keys))
    assert not journal.enabled and journal.full == 1
    assert not journal.path.exists() or journal.path.stat().st_size <= 1024


def test_the_journal_does_not_follow_a_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / DiskJournal.NAME).symlink_to(target)
    journal = DiskJournal(tmp_path)
    t, keys = _tracker(journal, 1)
    assert t.take_events(_disk_stored(keys))
    assert target.read_bytes() == b"" and not journal.enabled


def test_a_decodable_record_of_wrong_types_is_skipped_at_the_handshake(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import OffloadKey

    m = _manager(tmp_path)
    rc = ReqContext(req_id="a")
    keys = [_k(1), _k(2)]
    for i, k in enumerate(keys):
        rc.set_offload_key_position(k, (i + 1) * TOKENS)
    out = m.prepare_store(keys, rc)
    m.complete_store(out.keys_to_store, rc)
    list(m.take_events())
    good = ["+", bytes(keys[0]), [bytes(keys[0])], None, list(range(TOKENS)), TOKENS, None, None, 0, "full_attention", None]
    bad = ["+", bytes(keys[1]), "not a list", None, list(range(TOKENS)), "16", None, None, 0, "full_attention", None]
    journal = DiskJournal(tmp_path)
    journal.path.write_bytes(b"".join(_frame(msgspec.msgpack.encode(r)) for r in (good, bad)))
    t, _ = _tracker(journal, 0)
    assert events_mod.announce_adopted(m, t, journal) == 1  # raised TypeError at the handshake before
    assert OffloadKey(bytes(keys[0])) in t._pending_event_metadata
    assert journal.bad_records == 1
    assert list(journal.load()) == [bytes(keys[0])]


class _Scheduler:
    def __init__(self, manager: KvtierManager, fail: bool) -> None:
        self.manager, self.fail = manager, fail

    def take_events(self):  # noqa: ANN201 - vLLM's scheduler translates the manager's events
        return [("removed" if e.removed else "stored", tuple(e.keys)) for e in self.manager.take_events()]

    def reset_cache(self) -> None:
        self.manager.reset_cache()
        if self.fail:
            raise RuntimeError("vLLM's reset failed")


def _connector(manager: KvtierManager, fail: bool) -> KvtierConnector:
    c = object.__new__(KvtierConnector)
    c.connector_scheduler = _Scheduler(manager, fail)
    c._group_rules, c._block_tokens, c._early, c._journal = {}, {}, [], None
    return c


def test_a_reset_whose_vllm_reset_raises_keeps_its_removals(tmp_path: Path) -> None:
    m = _manager(tmp_path, cpu=4 * CHUNK)
    rc = ReqContext(req_id="a")
    rc.set_offload_key_position(_k(1), TOKENS)
    m.complete_store(m.prepare_store([_k(1)], rc).keys_to_store, rc)
    c = _connector(m, fail=True)
    list(c.take_events())
    with pytest.raises(RuntimeError):
        c.reset_cache()
    assert ("removed", (_k(1),)) in list(c.take_events())  # lost before: drained, never kept


def test_a_reset_is_marked_again_once_its_jobs_are_flushed(tmp_path: Path, monkeypatch) -> None:
    m = _manager(tmp_path)
    c = _connector(m, fail=False)
    root = m.ctx.disk_root
    root.mkdir(parents=True, exist_ok=True)  # the workers' disk tier makes it
    c.reset_cache()
    first = rebuild.reset_time(root)
    assert first > 0
    rc = ReqContext(req_id="b")  # a store prepared after the reset: submitted after the flush
    rc.set_offload_key_position(_k(3), TOKENS)
    out = m.prepare_store([_k(3)], rc)
    assert rebuild.reset_time(root) == first
    m.complete_store(out.keys_to_store, rc)
    second = rebuild.reset_time(root)
    assert second > first  # an old job's write made after the first mark is not adopted
    m.complete_store(m.prepare_store([_k(4)], rc).keys_to_store, rc)
    assert rebuild.reset_time(root) == second  # once per reset
    c.reset_cache()
    third = rebuild.reset_time(root)
    m.on_reset_flushed()  # vLLM 0.33 reports the flush
    assert rebuild.reset_time(root) > third


def test_the_reset_mark_is_fsynced_with_its_directory(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    rebuild.mark_reset(tmp_path)
    assert len(synced) == 2 and rebuild.reset_time(tmp_path) > 0
    assert (tmp_path / rebuild.RESET_FILE).stat().st_mode & 0o777 == 0o600
