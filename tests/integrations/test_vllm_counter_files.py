"""The counter files under `<kvtier.directory>/metrics` (integrations/vllm/counters.py), on real
files: the directory is kvtier's own (never a symlink, never another user's, never writable by
others), files are created and replaced relative to it without following links, the prune of dead
processes' files removes only kvtier's own regular files, and the readers never follow a link or
open a FIFO. The tests run as root (a root-owned 0600 file was overwritten through a planted link)
and give files away with os.chown."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import counters  # noqa: E402
from kvtier.integrations.vllm.counters import Metrics, read_info, read_metrics  # noqa: E402

OTHER_UID = 12345
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user (os.chown)")


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)


def _victim(path: Path, text: str = "root's own\n") -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def _counts(metrics_dir: Path) -> dict:
    return json.loads((metrics_dir / f"scheduler-{os.getpid()}.json").read_text())["counts"]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "kvtier.vllm"]


def test_a_symlinked_metrics_dir_is_never_written_through_nor_pruned(tmp_path: Path, caplog) -> None:
    """`metrics` is a link to another directory: nothing is written there and nothing there is
    removed (the old code wrote its file there and pruned that directory's dead-pid files); the
    engine keeps running with one warning, and the readers do not follow the link either."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    dead = _dead_pid()
    kept = _victim(elsewhere / f"worker0-{dead}.json", '{"counts": {"x": 1}}')
    before = sorted(p.name for p in elsewhere.iterdir())
    kvdir = tmp_path / "kv"
    kvdir.mkdir()
    (kvdir / "metrics").symlink_to(elsewhere)
    caplog.set_level(logging.WARNING, logger="kvtier.vllm")
    m = Metrics("scheduler", str(kvdir))
    m.add("lookup_keys")
    m.flush(force=True)  # never raises: the engine does not fail over a counter file
    m.add("lookup_keys")
    m.flush(force=True)
    assert sorted(p.name for p in elsewhere.iterdir()) == before
    assert kept.read_text() == '{"counts": {"x": 1}}'
    assert (kvdir / "metrics").is_symlink()
    warned = _warnings(caplog)
    assert len(warned) == 1 and "metrics" in warned[0], warned  # once, not every second
    assert read_metrics(kvdir) == {} and read_info(kvdir) == {}
    assert m.take_delta() == {("lookup_keys", ""): 2}  # vLLM's stats path still has every count


def test_a_planted_link_at_the_temporary_or_final_name_is_never_written_through(tmp_path: Path) -> None:
    """The temporary file had a predictable name (`<role>-<pid>.tmp`) and was written with
    write_text, through a link planted there: a root-owned 0600 file was overwritten with the
    counters. Now the temporary name is random and created O_EXCL|O_NOFOLLOW, and the rename onto
    the final name replaces a link planted there (the link's target is untouched)."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir(mode=0o700)
    pid = os.getpid()
    tmp_victim = _victim(tmp_path / "tmp-victim")
    final_victim = _victim(tmp_path / "final-victim")
    (metrics_dir / f"scheduler-{pid}.tmp").symlink_to(tmp_victim)
    (metrics_dir / f"scheduler-{pid}.json").symlink_to(final_victim)
    m = Metrics("scheduler", str(tmp_path))
    m.add("load_jobs", 3)
    m.flush(force=True)
    assert tmp_victim.read_text() == "root's own\n"
    assert final_victim.read_text() == "root's own\n"
    final = metrics_dir / f"scheduler-{pid}.json"
    st = final.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 1
    assert _counts(metrics_dir) == {"load_jobs": 3}
    # no temporary file is left behind, and the planted link is only in the way of no one
    assert sorted(p.name for p in metrics_dir.iterdir()) == [f"scheduler-{pid}.json", f"scheduler-{pid}.tmp"]


def test_the_temporary_name_is_not_predictable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writes of one process use two different temporary names, neither `<role>-<pid>.tmp`
    (whatever name would be planted in advance is not the one used)."""
    names: list[str] = []
    real = counters.os.replace

    def replace(src, dst, **kw):  # type: ignore[no-untyped-def]
        names.append(os.fsdecode(src))
        return real(src, dst, **kw)

    monkeypatch.setattr(counters.os, "replace", replace)
    m = Metrics("worker0", str(tmp_path))
    for _ in range(2):
        m.add("store_jobs")
        m.flush(force=True)
    # (the first count's timer may write too: at least the two forced writes)
    assert len(names) >= 2 and len(set(names)) == len(names), names
    assert all(Path(n).name != f"worker0-{os.getpid()}.tmp" for n in names), names
    assert read_metrics(tmp_path) == {"store_jobs": 2}


@needs_root
@pytest.mark.parametrize("how", ["mode-0777", "other-owner"])
def test_a_metrics_dir_open_to_others_is_refused(tmp_path: Path, caplog, how: str) -> None:
    """A `metrics` directory that group or others may write, or that another user owns, is not
    used (anyone who can write it can plant links and forged files): no counter file, one warning
    naming the fix, no exception."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    if how == "mode-0777":
        metrics_dir.chmod(0o777)
    else:
        metrics_dir.chmod(0o700)
        os.chown(metrics_dir, OTHER_UID, OTHER_UID)
    caplog.set_level(logging.WARNING, logger="kvtier.vllm")
    m = Metrics("scheduler", str(tmp_path))
    m.add("resets")
    m.flush(force=True)
    assert list(metrics_dir.iterdir()) == []
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert ("chmod 700" in warned[0]) if how == "mode-0777" else (str(OTHER_UID) in warned[0]), warned
    # the operator fixes it: the next write lands
    os.chown(metrics_dir, os.geteuid(), os.getegid())
    metrics_dir.chmod(0o700)
    m.add("resets")
    m.flush(force=True)
    assert _counts(metrics_dir) == {"resets": 2}


@needs_root
def test_prune_removes_only_kvtiers_own_regular_files_of_dead_processes(tmp_path: Path) -> None:
    """The prune of dead processes' files removed every `*-*.json` whose number was no live pid:
    another program's file, another user's, a link, a FIFO. Now only names kvtier writes
    (`scheduler-<pid>.json`, `worker<rank>-<pid>.json`, its temporary files) that are regular
    files of this user."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir(mode=0o700)
    dead = _dead_pid()
    target = _victim(tmp_path / "target.json", '{"counts": {"linked": 1}}')
    ours = [f"worker0-{dead}.json", f"scheduler-{dead}.json", f"worker3-{dead}.json"]
    for name in ours:
        _victim(metrics_dir / name, '{"counts": {"old": 1}}')
    _victim(metrics_dir / f"notes-{dead}.json", "{}")  # not a name kvtier writes
    _victim(metrics_dir / f"worker1-{dead}.json", '{"counts": {"theirs": 1}}')
    os.chown(metrics_dir / f"worker1-{dead}.json", OTHER_UID, OTHER_UID)  # another user's
    (metrics_dir / f"worker2-{dead}.json").symlink_to(target)  # a link
    os.mkfifo(metrics_dir / f"worker4-{dead}.json", 0o600)  # a FIFO
    (metrics_dir / f"worker5-{dead}.json").mkdir()  # a directory
    kept = sorted(p.name for p in metrics_dir.iterdir() if p.name not in ours)
    m = Metrics("scheduler", str(tmp_path))
    m.add("resets")
    m.flush(force=True)
    assert sorted(p.name for p in metrics_dir.iterdir()) == sorted(kept + [f"scheduler-{os.getpid()}.json"])
    assert target.read_text() == '{"counts": {"linked": 1}}'
    assert (metrics_dir / f"worker2-{dead}.json").is_symlink()


def test_the_readers_skip_links_fifos_and_directories(tmp_path: Path) -> None:
    """read_metrics / read_info read regular files only: a link is not followed (its target may
    be any file), a FIFO is neither read nor waited on (a blocking open would hang the reader
    until a writer came), a directory is skipped."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir(mode=0o700)
    (metrics_dir / "scheduler-1.json").write_text('{"counts": {"a": 1}, "info": {"i": 7}}')
    target = tmp_path / "target.json"
    target.write_text('{"counts": {"a": 100, "linked": 1}, "info": {"linked": 1}}')
    (metrics_dir / "worker0-2.json").symlink_to(target)
    os.mkfifo(metrics_dir / "worker1-3.json", 0o600)
    (metrics_dir / "worker2-4.json").mkdir()
    out: dict[str, object] = {}

    def read() -> None:
        out["metrics"] = read_metrics(tmp_path)
        out["info"] = read_info(tmp_path)

    reader = threading.Thread(target=read, daemon=True)  # a hung open must fail the test, not hang it
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), "the reader hung on the FIFO"
    assert out == {"metrics": {"a": 1}, "info": {"i": 7}}
