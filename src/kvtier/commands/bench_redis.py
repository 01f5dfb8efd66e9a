"""`kvtier bench redis`: the redis tier against raw redis-py on the same server, as ratios.

Both sides move the same chunk payloads (seeded random bytes) in one batch per round:
- save: `RedisTier.write_many` (header, checksum, MAC with --secret, one value per chunk,
  TTL-less SET, streamed zero-copy with each value sealed while the previous one is sent:
  `tiers/redis_wire.py`) against a raw pipelined `SET key <the payload's memoryview>` (redis-py
  sends a memoryview without a copy);
- load: `RedisTier.read_many` into preallocated uint8 buffers (header and checksum, or the MAC
  alone with --secret, verified in the same pass as the one copy into the buffer) against a raw
  pipelined `GET` that returns bytes and stops there.
The two alternate within each round (which goes first flips every round) and the figures are
medians over rounds; ratios are kvtier's throughput over raw's (1.0 = as fast). Without --url
a redis-server is started on a free loopback port in a temp dir, with a random password (any
local user can reach a loopback port), and stopped afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvtier.errors import ConfigError, KvtierError
from kvtier.loadgen.servers import free_port, redis_server, wait_redis_ready

HELP = "redis tier save/load throughput against raw redis-py pipelined SET/GET, as ratios"

BENCH_NS = "b0b0b0b0b0b0b0b0"
KEY_PREFIX = "kvtier-bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running Redis (redis://, rediss://, redis+cluster://, "
                                 "redis+sentinel://); "
                                 "default: start a redis-server on a free loopback port")
    p.add_argument("--chunk-bytes", type=int, default=256 << 10, metavar="N",
                   help="bytes per chunk payload (default 256 KiB)")
    p.add_argument("--chunks", type=int, default=64, metavar="N",
                   help="chunk payloads per round, in one batch (default 64)")
    # 31 rounds: a round is milliseconds, so a median over few rounds moves with one scheduling hiccup
    p.add_argument("--rounds", type=int, default=31, metavar="N", help="rounds (default 31)")
    p.add_argument("--secret", action="store_true",
                   help="key the tier with a random tenant secret (a MAC on every value): the ratios "
                        "then show what the key costs")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@contextlib.contextmanager
def own_server() -> Iterator[str]:
    """A redis-server on a free loopback port, persistence off, always stopped
    (`kvtier.loadgen.servers.redis_server`, with a random password kept in 0600 files, never on
    the command line); yields its URL, which carries that password
    (`redis://:PASSWORD@127.0.0.1:PORT/0`; every message shows it through `redact`). TCP, not a
    Unix socket in the private directory: the bench measures the transport `--url` and real
    deployments use."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise KvtierError("redis-server not found; install it (apt-get install redis-server) "
                          "or pass --url")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as d:  # mode 0700
        port = free_port()
        proc, password_file = redis_server(exe, port, Path(d), Path(d) / "redis.log")
        assert password_file is not None
        try:
            wait_redis_ready(proc, "127.0.0.1", port, time.monotonic() + 10, password_file)  # ServerFailed
            yield f"redis://:{password_file.read_text()}@127.0.0.1:{port}/0"
        finally:
            proc.stop(grace_s=5)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(url: str, chunk_bytes: int, chunks: int, rounds: int, secret: bool = False) -> dict[str, object]:
    import redis
    import torch

    from kvtier.store.payload import CHECKSUM_NAMES, DEFAULT_CHECKSUM, make_header
    from kvtier.store.tiers.redis import RedisOptions, RedisTier
    from kvtier.store.tiers.redis_conn import build_client, redact

    opts = RedisOptions(url=url, key_prefix=KEY_PREFIX, socket_timeout_s=30.0,
                        connect_timeout_s=5.0)
    gen = torch.Generator().manual_seed(0)
    datas = [torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=gen)
             for _ in range(chunks)]
    headers = [make_header(BENCH_NS, i.to_bytes(8, "little") * 4, 0, 256 * i, 256 * (i + 1),
                           chunk_bytes) for i in range(chunks)]
    raw_keys = [f"{KEY_PREFIX}:raw:{{{i}}}" for i in range(chunks)]
    outs = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(chunks)]
    views = [d.numpy().data for d in datas]

    def kv_save() -> None:
        if not all(tier.write_many([(0, 0, h, d) for h, d in zip(headers, datas)])):
            raise KvtierError(f"redis tier could not save to {redact(url)}: {tier.last_error}")

    def kv_load() -> None:
        if not all(tier.read_many([(0, 0, h, o) for h, o in zip(headers, outs)])):
            raise KvtierError(f"redis tier could not load from {redact(url)} (evicted? maxmemory)")

    def raw_save() -> None:
        p = raw.pipeline(transaction=False)  # type: ignore[attr-defined]
        for k, v in zip(raw_keys, views):
            p.set(k, v)
        p.execute()

    def raw_load() -> None:
        p = raw.pipeline(transaction=False)  # type: ignore[attr-defined]
        for k in raw_keys:
            p.get(k)
        got = p.execute()
        if any(g is None for g in got):
            raise KvtierError(f"raw GET missed on {redact(url)} (evicted? maxmemory)")

    try:
        raw = build_client(opts)  # the same connection settings, used through plain redis-py
        raw.ping()  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001
        raise KvtierError(f"cannot reach Redis at {redact(url)}: {exc}") from None
    from kvtier.store.integrity import Keyed, mac_name

    tier = RedisTier(opts, namespace_id=BENCH_NS, keyed=Keyed(os.urandom(32)) if secret else None)
    try:
        kv_save(), raw_save(), kv_load(), raw_load()  # warm-up: connections, allocator
        t: dict[str, list[float]] = {k: [] for k in ("kv_save", "raw_save", "kv_load", "raw_load")}
        for r in range(rounds):
            order = (("kv", "raw") if r % 2 == 0 else ("raw", "kv"))
            for side in order:
                t[f"{side}_save"].append(_timed(kv_save if side == "kv" else raw_save))
            for side in order:
                t[f"{side}_load"].append(_timed(kv_load if side == "kv" else raw_load))
        if not all(torch.equal(o, d) for o, d in zip(outs, datas)):
            raise KvtierError("redis tier loaded bytes that differ from the saved ones")
    finally:
        with contextlib.suppress(Exception):
            tier.delete_many(headers)
            raw.delete(*raw_keys)  # type: ignore[attr-defined]
        tier.close()
        with contextlib.suppress(Exception):
            raw.close()  # type: ignore[attr-defined]

    total = chunk_bytes * chunks
    med = {k: statistics.median(v) for k, v in t.items()}
    gbs = {k: total / v / 1e9 for k, v in med.items()}
    return {
        "save_ratio": med["raw_save"] / med["kv_save"],
        "load_ratio": med["raw_load"] / med["kv_load"],
        "kvtier_save_gb_s": gbs["kv_save"], "raw_save_gb_s": gbs["raw_save"],
        "kvtier_load_gb_s": gbs["kv_load"], "raw_load_gb_s": gbs["raw_load"],
        "chunk_bytes": chunk_bytes, "chunks": chunks, "rounds": rounds,
        "checksum": CHECKSUM_NAMES[DEFAULT_CHECKSUM], "hiredis": _has_hiredis(),
        "redis_py": redis.__version__, "keyed": secret,
        "mac": mac_name() if secret else None,
    }


def _has_hiredis() -> bool:
    import importlib.util

    return importlib.util.find_spec("hiredis") is not None


def run(args: argparse.Namespace) -> int:
    for name in ("chunk_bytes", "chunks", "rounds"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0")
    if args.url:
        res = measure(args.url, args.chunk_bytes, args.chunks, args.rounds, args.secret)
        res["server"] = "given"
    else:
        with own_server() as url:
            res = measure(url, args.chunk_bytes, args.chunks, args.rounds, args.secret)
        res["server"] = "own redis-server on loopback"
    if args.json:
        print(json.dumps(res))
        return 0
    mib = args.chunk_bytes / (1 << 20)
    print(f"redis tier vs raw redis-py, {args.chunks} chunks of {mib:.2f} MiB per batch, "
          f"median of {args.rounds} rounds ({res['server']}; checksum {res['checksum']}"
          + (f"; keyed: {res['mac']} on every value" if res["keyed"] else "") + ")")
    print(f"  save  kvtier {res['kvtier_save_gb_s']:.2f} GB/s  raw SET {res['raw_save_gb_s']:.2f} "
          f"GB/s  ratio {res['save_ratio']:.2f}")
    print(f"  load  kvtier {res['kvtier_load_gb_s']:.2f} GB/s  raw GET {res['raw_load_gb_s']:.2f} "
          f"GB/s  ratio {res['load_ratio']:.2f}")
    return 0
