"""`kvtier bench redis`: the redis tier against raw redis-py on the same server, as ratios.

Every side moves the same chunk payloads (seeded random bytes) in one batch per round:
- save: `RedisTier.write_many` (header, checksum, MAC with --secret, one value per chunk,
  TTL-less SET, streamed zero-copy, each value sealed just before it is sent:
  `tiers/redis_wire.py`) against a raw pipelined `SET key <the payload's memoryview>` (redis-py
  sends a memoryview without a copy);
- load: `RedisTier.read_many` into preallocated uint8 buffers (header and checksum, or the MAC
  alone with --secret, verified in the same pass as the one copy into the buffer) against a raw
  pipelined `GET` that returns bytes and stops there.
Raw redis-py runs once per reply parser this build has, hiredis' C parser and redis-py's own, and
each ratio is against the stronger (both reported): a baseline without hiredis flattered loads.
Beside them, for what the wire allows: kvtier's streams with nothing sealed or checked (`wire_*`),
and the save's limit on one core, raw SET time against raw + the seal's passes over the same
bytes (xxh3; with --secret also OpenSSL's MAC), timed in the same rounds.
The sides alternate within each round (the order flips every round) and the figures are
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


def _raw_clients(opts: object) -> dict[str, object]:
    """Plain redis-py clients with the tier's connection settings, one per reply parser this
    build has: `hiredis` (its C parser, when installed) and `pure` (redis-py's own Python
    parser). A Cluster client keeps redis-py's default parser (reported as whichever it is)."""
    from redis._parsers import _HiredisParser, _RESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    from kvtier.store.tiers.redis_conn import build_client

    parsers = {"hiredis": _HiredisParser} if HIREDIS_AVAILABLE else {}
    parsers["pure"] = _RESP2Parser
    out: dict[str, object] = {}
    for name, parser in parsers.items():
        client = build_client(opts)  # type: ignore[arg-type]
        pool = getattr(client, "connection_pool", None)
        if pool is None:  # Cluster: one client, redis-py's default parser
            return {"hiredis" if HIREDIS_AVAILABLE else "pure": client}
        pool.connection_kwargs["parser_class"] = parser  # before its first connection
        out[name] = client
    return out


def measure(url: str, chunk_bytes: int, chunks: int, rounds: int, secret: bool = False) -> dict[str, object]:
    import redis
    import torch

    from kvtier.store.integrity import Keyed, mac_name
    from kvtier.store.store import SHARED_SLOT  # what the store passes a key-addressed tier
    from kvtier.store.payload import CHECKSUM_NAMES, CHECKSUM_XXH3, DEFAULT_CHECKSUM, MAC_GMAC, checksum, make_header
    from kvtier.store.tiers.redis import RedisOptions, RedisTier
    from kvtier.store.tiers.redis_conn import redact
    from kvtier.store.tiers.redis_reader import Streamed
    from kvtier.store.tiers.redis_wire import get_stream, set_stream

    opts = RedisOptions(url=url, key_prefix=KEY_PREFIX, socket_timeout_s=30.0,
                        connect_timeout_s=5.0)
    gen = torch.Generator().manual_seed(0)
    datas = [torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=gen)
             for _ in range(chunks)]
    headers = [make_header(BENCH_NS, i.to_bytes(8, "little") * 4, 0, 256 * i, 256 * (i + 1),
                           chunk_bytes) for i in range(chunks)]
    raw_keys = [f"{KEY_PREFIX}:raw:{{{i}}}" for i in range(chunks)]
    wire_keys = [f"{KEY_PREFIX}:wire:{{{i}}}" for i in range(chunks)]
    outs = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(chunks)]
    wire_outs = [memoryview(bytearray(chunk_bytes + 128)) for _ in range(chunks)]
    views = [d.numpy().data for d in datas]
    keyed = Keyed(os.urandom(32)) if secret else None
    mac_keyed = keyed if keyed is not None and keyed.kind == MAC_GMAC else None
    fixed_header = bytes(128)

    def kv_save() -> None:
        if not all(tier.write_many([(0, SHARED_SLOT, h, d) for h, d in zip(headers, datas)])):
            raise KvtierError(f"redis tier could not save to {redact(url)}: {tier.last_error}")

    def kv_load() -> None:
        if not all(tier.read_many([(0, SHARED_SLOT, h, o) for h, o in zip(headers, outs)])):
            raise KvtierError(f"redis tier could not load from {redact(url)} (evicted? maxmemory)")

    def raw_save(client: object) -> Callable[[], None]:
        def save() -> None:
            p = client.pipeline(transaction=False)  # type: ignore[attr-defined]
            for k, v in zip(raw_keys, views):
                p.set(k, v)  # a memoryview: sent without a copy
            p.execute()
        return save

    def raw_load(client: object) -> Callable[[], None]:
        def load() -> None:
            p = client.pipeline(transaction=False)  # type: ignore[attr-defined]
            for k in raw_keys:
                p.get(k)
            if any(g is None for g in p.execute()):
                raise KvtierError(f"raw GET missed on {redact(url)} (evicted? maxmemory)")
        return load

    def wire_save() -> None:  # kvtier's save stream, a fixed header: no pass over the bytes
        set_stream(wire, wire_keys, headers, views, None, None, [], seal=lambda h, v, k: fixed_header)

    def wire_direct(k: int, r: object, length: int) -> Streamed:
        r.into(wire_outs[k][:length])  # type: ignore[attr-defined]
        return Streamed(None)

    def wire_load() -> None:  # kvtier's load stream into the buffers, nothing checked
        get_stream(wire, [("GET", k) for k in wire_keys], chunks, wire_direct, lambda k, raw: None)

    def seal_xxh3() -> None:  # the checksum pass a save makes, over the same bytes
        for v in views:
            checksum(v, CHECKSUM_XXH3)

    def seal_mac() -> None:  # OpenSSL's MAC of the same bytes (key derivation included)
        for h, v in zip(headers, views):
            mac_keyed.mac(h, v)  # type: ignore[union-attr]

    try:
        raws = _raw_clients(opts)
        for c in raws.values():
            c.ping()  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001
        raise KvtierError(f"cannot reach Redis at {redact(url)}: {exc}") from None
    wire = next(iter(raws.values())) if not opts.is_cluster else None

    tier = RedisTier(opts, namespace_id=BENCH_NS, keyed=keyed)
    sides: dict[str, Callable[[], None]] = {"kv_save": kv_save}
    sides.update({f"raw_save_{n}": raw_save(c) for n, c in raws.items()})
    sides["kv_load"] = kv_load
    sides.update({f"raw_load_{n}": raw_load(c) for n, c in raws.items()})
    if wire is not None:
        sides.update(wire_save=wire_save, wire_load=wire_load)
    if DEFAULT_CHECKSUM == CHECKSUM_XXH3:
        sides["xxh3"] = seal_xxh3
    if mac_keyed is not None:
        sides["mac"] = seal_mac
    try:
        for fn in sides.values():  # warm-up: connections, allocator; the saves before the loads
            fn()
        t: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(rounds):
            for name, fn in (list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]):
                t[name].append(_timed(fn))
        if not all(torch.equal(o, d) for o, d in zip(outs, datas)):
            raise KvtierError("redis tier loaded bytes that differ from the saved ones")
    finally:
        with contextlib.suppress(Exception):
            tier.delete_many(headers)
            next(iter(raws.values())).delete(*raw_keys, *wire_keys)  # type: ignore[attr-defined]
        tier.close()
        for c in raws.values():
            with contextlib.suppress(Exception):
                c.close()  # type: ignore[attr-defined]
    return _figures(t, chunk_bytes, chunks, rounds, secret) | {
        "checksum": CHECKSUM_NAMES[DEFAULT_CHECKSUM], "hiredis": _has_hiredis(),
        "redis_py": redis.__version__, "keyed": secret, "mac": mac_name() if secret else None,
    }


def _figures(t: dict[str, list[float]], chunk_bytes: int, chunks: int, rounds: int,
             secret: bool) -> dict[str, object]:
    """Medians, GB/s and ratios of the timed sides. Each ratio is kvtier's throughput over the
    strongest raw client's (1.0 = as fast); the limit is what sealing inline on one core allows:
    raw save time against raw + the seal's passes over the same bytes, timed side by side."""
    total = chunk_bytes * chunks
    med = {k: statistics.median(v) for k, v in t.items()}
    gbs = {k: total / v / 1e9 for k, v in med.items()}
    res: dict[str, object] = {}
    for op in ("save", "load"):
        clients = [k.rsplit("_", 1)[1] for k in med if k.startswith(f"raw_{op}_")]
        best = min(clients, key=lambda c: med[f"raw_{op}_{c}"])
        res[f"{op}_ratio"] = med[f"raw_{op}_{best}"] / med[f"kv_{op}"]
        res[f"kvtier_{op}_gb_s"], res[f"raw_{op}_gb_s"] = gbs[f"kv_{op}"], gbs[f"raw_{op}_{best}"]
        res[f"raw_{op}_strongest"] = best
        for c in clients:
            res[f"raw_{op}_{c}_gb_s"] = gbs[f"raw_{op}_{c}"]
            res[f"{op}_ratio_{c}"] = med[f"raw_{op}_{c}"] / med[f"kv_{op}"]
        if f"wire_{op}" in med:  # the stream with nothing sealed or checked: what the wire allows
            res[f"wire_{op}_gb_s"] = gbs[f"wire_{op}"]
    raw = med[f"raw_save_{res['raw_save_strongest']}"]
    seal = med.get("xxh3", 0.0) + med.get("mac", 0.0)
    res["raw_save_ms"] = raw * 1e3
    res["xxh3_ms"] = med["xxh3"] * 1e3 if "xxh3" in med else None
    res["mac_ms"] = med["mac"] * 1e3 if "mac" in med else None
    res["save_limit_ratio"] = raw / (raw + seal)  # raw SET, then every seal pass, one core
    res["save_of_limit"] = float(res["save_ratio"]) / res["save_limit_ratio"]  # type: ignore[arg-type]
    if "mac" in med:  # had the MAC been the only pass (no xxh3 checksum under it)
        res["save_limit_mac_only_ratio"] = raw / (raw + med["mac"])
    res.update(chunk_bytes=chunk_bytes, chunks=chunks, rounds=rounds)
    return res


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
    for op, cmd in (("save", "SET"), ("load", "GET")):
        others = ", ".join(f"{c} {res[f'raw_{op}_{c}_gb_s']:.2f}" for c in ("hiredis", "pure")
                           if f"raw_{op}_{c}_gb_s" in res)
        wire = f"  (stream alone {res[f'wire_{op}_gb_s']:.2f} GB/s)" if f"wire_{op}_gb_s" in res else ""
        print(f"  {op}  kvtier {res[f'kvtier_{op}_gb_s']:.2f} GB/s  raw {cmd} {res[f'raw_{op}_gb_s']:.2f} "
              f"GB/s ({res[f'raw_{op}_strongest']}; {others})  ratio {res[f'{op}_ratio']:.2f}{wire}")
    print(f"  save limit (raw SET + the seal's passes over the same bytes, one core) "
          f"{res['save_limit_ratio']:.2f}; kvtier at {res['save_of_limit']:.2f} of it")
    return 0
