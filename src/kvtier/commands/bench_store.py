"""`kvtier bench store`: the store's save/load throughput against plain copies of the same bytes.

Measured side by side in one run, interleaved round by round (the order alternates), on a
4-group hybrid geometry (full, sliding, MLA, state): for each round the ratio
plain_seconds / kvtier_seconds is taken, and the median over rounds is reported (1.0 = as
fast as the plain copy).

- cpu: `Store.save` / `Store.load` through a cpu-only store (index, headers, slab slots) vs a
  plain `torch` copy of exactly the same payloads into / out of preallocated tensors.
- disk: the same through a disk-only store (pwrite/preadv of slab slots, a header and an
  xxh3/crc32 checksum per chunk, checksum verified on every load) vs a plain sequential
  write / read of the same bytes to one preexisting file (fdatasync after each payload when the
  tier uses fsync="always"). Both run against the page cache (warm), as a cache re-read is.
- the disk paths' measured serial limit (`_limits`): in the same rounds, alternated, the
  passes a verified path adds are timed alone over the same bytes (the payload checksum, xxh3;
  with --secret OpenSSL's MAC through `integrity.Keyed`, its per-value key included), and
  `disk_{save,load}_limit_ratio` = plain / (plain + those passes), what one core running them
  one after the other allows; `disk_{save,load}_of_limit` = the measured ratio over it. With
  --secret also the MAC as a keyed load runs it, on pieces already in cache
  (`disk_load_mac_hot_ms`, `disk_load_limit_hot_ratio`, `disk_load_of_limit_hot`).
- lookup: `Store.lookup` of a 131072-token prompt fully cached on the 4-group geometry
  (512 chunks): `lookup_chunks_per_s` = prompt chunks / median lookup time; chunk hashing
  (kvtier.core.keys) is reported apart (`hash_ms_128k`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HELP = "store save/load vs plain torch copy and plain file I/O, as ratios; lookup throughput"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=11, help="rounds per measurement (median; default 11)")
    p.add_argument("--chunks", type=int, default=4, help="prompt chunks per round (default 4: 90 MiB saved, 58 MiB loaded)")
    p.add_argument("--fsync", choices=("never", "always"), default="never",
                   help="disk tier fsync policy; the plain baseline fsyncs alike")
    p.add_argument("--dir", help="directory for the disk files (default: a temporary one)")
    p.add_argument("--cold", action="store_true",
                   help="disk loads from storage: flush and drop both sides' files from the page "
                        "cache (posix_fadvise DONTNEED) before every load round")
    p.add_argument("--torch-threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads for both sides (default 1: on a busy host torch's "
                        "thread pool makes a 2 MiB copy several times slower)")
    p.add_argument("--disk-pipeline", choices=("auto", "always", "never"), default=None,
                   help="disk tier: write a save's payloads on two lanes (this thread and a helper) and "
                        "overlap cold reads with their checksum (auto: while the load average leaves half "
                        "a core free; default: the tier's own)")
    p.add_argument("--disk-reads", choices=("mapped", "preadv"), default=None,
                   help="disk tier loads: mapped (copy + checksum from the mapped page cache, for "
                        "resident slots; the default) or preadv (always one preadv + one checksum pass)")
    p.add_argument("--secret", action="store_true",
                   help="key the disk tier with a random tenant secret: every payload MACed (keyed "
                        "BLAKE3, BLAKE2b without the blake3 package) on save and verified on load; the "
                        "disk ratios then show its cost")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def bench_geometry(small: bool = False):  # type: ignore[no-untyped-def]
    """4 groups: full, sliding (W=512), MLA, state. `small`: same layout, 64x fewer bytes (for
    the lookup bench: lookup never touches payloads, and its slabs then stay small)."""
    from kvtier.core.geometry import Geometry, Group

    d = 64 if small else 1
    return Geometry(
        name="bench-4-group",
        groups=(
            # bf16 with 4 KV heads of 128: 2 KiB per token per layer -> 8 MiB chunks of 256 tokens
            Group("full", "full", num_layers=16, tokens_per_block=16, bytes_per_token_per_layer=2048 // d),
            Group("local", "sliding", num_layers=16, tokens_per_block=16, bytes_per_token_per_layer=2048 // d,
                  window=512),
            Group("mla", "mla", num_layers=8, tokens_per_block=64, bytes_per_token_per_layer=1152 // d),
            Group("ssm", "state", num_layers=4, tokens_per_block=16, state_bytes_per_layer=1024 * 1024 // d),
        ),
        tokens_per_hash=16,
    )


def _drop_cache(fds: list[int]) -> None:
    for fd in fds:
        os.fsync(fd)  # DONTNEED drops clean pages only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _median_ratio(plain: list[float], ours: list[float]) -> float:
    return statistics.median(p / o for p, o in zip(plain, ours))


def run(args: argparse.Namespace) -> int:
    from kvtier.store.tiers import disk as disk_mod

    default_mode, default_mapped = disk_mod.PIPELINE, disk_mod.MAPPED_READS
    try:
        return _run(args)
    finally:  # --disk-pipeline and --disk-reads are for this run only
        disk_mod.PIPELINE, disk_mod.MAPPED_READS = default_mode, default_mapped


def _run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.errors import ConfigError
    from kvtier.core.keys import Namespace
    from kvtier.core.plan import make_plan
    from kvtier.store.store import Store

    if args.rounds < 1 or args.chunks < 1 or args.torch_threads < 1:
        raise ConfigError(f"--rounds {args.rounds}, --chunks {args.chunks} and --torch-threads "
                          f"{args.torch_threads} must be >= 1")
    torch.set_num_threads(args.torch_threads)
    geom = bench_geometry()
    plan = make_plan(geom, chunk_tokens=256)
    ns = Namespace("bench", geom.fingerprint(), "bfloat16")
    C, n = plan.chunk_tokens, args.chunks
    row = plan.chunk_bytes_all_groups
    gen = torch.Generator().manual_seed(0)

    def prompt(k: int) -> list[int]:
        return [(k * 7919 + 31 * i) % 50000 for i in range(n * C + 1)]

    def payloads(keys: list[tuple[int, int]]) -> dict[tuple[int, int], torch.Tensor]:
        return {k: torch.randint(0, 256, (plan.groups[k[0]].chunk_bytes,), dtype=torch.uint8, generator=gen)
                for k in keys}

    save_keys = [(gp.index, i) for gp in plan.cacheable_groups for i in plan.store_chunks(gp.index, n * C)]
    src = payloads(save_keys)
    save_bytes = sum(t.numel() for t in src.values())
    rounds = args.rounds
    out: dict[str, object] = {"geometry": geom.name, "chunk_tokens": C, "prompt_chunks": n,
                              "rounds": rounds, "save_bytes_per_round": save_bytes, "fsync": args.fsync,
                              "torch_threads": args.torch_threads,
                              "disk_cache": "cold" if args.cold else "warm"}
    tmp = tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-bench-")

    def timed(f) -> tuple[float, float]:  # type: ignore[no-untyped-def]
        # process CPU time: the disk tier's helper thread is counted (the plain side has none)
        c0, t0 = time.process_time(), time.perf_counter()
        f()
        return time.perf_counter() - t0, time.process_time() - c0

    from kvtier.store.tiers import disk as disk_mod

    if args.disk_pipeline is not None:
        disk_mod.PIPELINE = args.disk_pipeline  # read by the Store's DiskTier at construction
    out["disk_pipeline"] = disk_mod.PIPELINE
    if args.disk_reads is not None:
        disk_mod.MAPPED_READS = args.disk_reads == "mapped"
    out["disk_reads"] = "mapped" if disk_mod.MAPPED_READS else "preadv"
    out["disk_keyed"] = bool(args.secret)
    if args.secret:
        from kvtier.store.integrity import mac_name

        out["mac"] = mac_name()

    for tier in ("cpu", "disk"):
        # room for one prompt: from round 1 on every save evicts the previous round's chunk
        # and reuses its slot (the steady state of a full cache; no first-touch page faults)
        kw = ({"cpu_bytes": n * row} if tier == "cpu" else
              {"disk_dir": os.path.join(tmp.name, "tier"), "disk_bytes": n * row, "fsync": args.fsync,
               "secret": os.urandom(32) if args.secret else None})
        store = Store(plan, ns, placement="every", **kw)  # type: ignore[arg-type]  # every chunk: tier speed, not placement
        plain_file = os.path.join(tmp.name, "plain.bin")
        with open(plain_file, "wb") as f:  # preexisting, as the tier's slab files are after round 0
            f.truncate(save_bytes)
        # destinations allocated and touched once: a fresh tensor per round would charge
        # first-touch page faults to whichever side runs first
        dst = {k: v.clone() for k, v in src.items()}  # the plain cpu copy's destination
        bufs = {k: v.clone() for k, v in src.items()}  # both sides' load buffers
        t_plain_s, t_ours_s, t_plain_l, t_ours_l = [], [], [], []  # wall seconds
        c_plain_s, c_ours_s, c_plain_l, c_ours_l = [], [], [], []  # this thread's CPU seconds
        # disk: the passes a verified path adds, timed alone over the same bytes in the same rounds
        # (`_limits`): name -> wall seconds a round
        t_pass: dict[str, list[float]] = {}
        if tier == "disk":
            passes = _passes(src, ns.id, bool(args.secret))
        for r in range(rounds + 1):  # round 0 warms up (first touch of slabs and files)
            hashes = store.hashes(prompt(r))
            hit_keys: list[tuple[int, int]] = []

            def ours_save() -> None:
                assert store.save(hashes, src, n * C + 1) == len(save_keys)

            def plain_save() -> None:
                if tier == "cpu":
                    for k, v in src.items():
                        dst[k].copy_(v)
                    return
                fd = os.open(plain_file, os.O_WRONLY)
                try:
                    for v in src.values():
                        os.write(fd, v.numpy())
                        if args.fsync == "always":
                            os.fdatasync(fd)
                finally:
                    os.close(fd)

            a, b = (plain_save, ours_save) if r % 2 else (ours_save, plain_save)
            ta, tb = timed(a), timed(b)
            tp, to = (ta, tb) if r % 2 else (tb, ta)
            if tier == "disk" and r:
                _time_passes(passes, "save", list(src), r, t_pass)
            hit = store.lookup(hashes, n * C + 1)
            hit_keys = hit.buffers_needed()

            def ours_load() -> None:
                assert store.load(hit, bufs) == n * C

            def plain_load() -> None:
                if tier == "cpu":
                    for k in hit_keys:
                        bufs[k].copy_(dst[k])
                    return
                fd = os.open(plain_file, os.O_RDONLY)
                try:
                    for k in hit_keys:
                        os.readv(fd, [bufs[k].numpy()])
                finally:
                    os.close(fd)

            if tier == "disk" and args.cold:
                _drop_cache([fd for fd in store.slot_tiers["disk"]._fds if fd is not None])  # type: ignore[attr-defined]
                pfd = os.open(plain_file, os.O_RDONLY)
                _drop_cache([pfd])
                os.close(pfd)
            a, b = (plain_load, ours_load) if r % 2 else (ours_load, plain_load)
            ta, tb = timed(a), timed(b)
            lp, lo = (ta, tb) if r % 2 else (tb, ta)
            if tier == "disk" and r:
                _time_passes(passes, "load", hit_keys, r, t_pass)
                if args.secret:
                    t_pass.setdefault("load_mac_hot", []).append(_mac_hot(passes, hit_keys))
            if r:
                t_plain_s.append(tp[0])
                t_ours_s.append(to[0])
                t_plain_l.append(lp[0])
                t_ours_l.append(lo[0])
                c_plain_s.append(tp[1])
                c_ours_s.append(to[1])
                c_plain_l.append(lp[1])
                c_ours_l.append(lo[1])
        load_bytes = sum(src[k].numel() for k in hit_keys)
        m = store.metrics()
        if tier == "disk":  # how many payloads the helper thread moved (--disk-pipeline)
            out["disk_helper_ios"] = store.slot_tiers["disk"].helper_ios  # type: ignore[attr-defined]
            out["disk_mapped_reads"] = store.slot_tiers["disk"].mapped_reads  # type: ignore[attr-defined]
        store.close()
        if m["corrupt_dropped"] or m["failed_saves"]:
            print(f"error: the {tier} bench saw {m['corrupt_dropped']} corrupt payloads and "
                  f"{m['failed_saves']} failed saves", file=sys.stderr)
            return 1
        out[f"{tier}_save_ratio"] = round(_median_ratio(t_plain_s, t_ours_s), 3)
        out[f"{tier}_load_ratio"] = round(_median_ratio(t_plain_l, t_ours_l), 3)
        if tier == "cpu" or not args.cold:  # a cold read waits for the device, not the CPU
            out[f"{tier}_save_cpu_time_ratio"] = round(_median_ratio(c_plain_s, c_ours_s), 3)
            out[f"{tier}_load_cpu_time_ratio"] = round(_median_ratio(c_plain_l, c_ours_l), 3)
        out[f"{tier}_save_gbps"] = round(save_bytes / statistics.median(t_ours_s) / 1e9, 2)
        out[f"{tier}_plain_save_gbps"] = round(save_bytes / statistics.median(t_plain_s) / 1e9, 2)
        out[f"{tier}_load_gbps"] = round(load_bytes / statistics.median(t_ours_l) / 1e9, 2)
        out[f"{tier}_plain_load_gbps"] = round(load_bytes / statistics.median(t_plain_l) / 1e9, 2)
        if tier == "disk":
            med = {f"plain_{op}": statistics.median(t) for op, t in (("save", t_plain_s), ("load", t_plain_l))}
            med.update({k: statistics.median(v) for k, v in t_pass.items()})
            out.update(_limits(med, {op: float(out[f"disk_{op}_ratio"]) for op in ("save", "load")},  # type: ignore[arg-type]
                               bool(args.secret)))
    out["load_bytes_per_round"] = load_bytes
    tmp.cleanup()
    out.update(_lookup_bench(rounds))
    out.update(_checksum_bound())
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"kvtier bench store: {geom.name}, chunk_tokens {C}, {n} chunks a prompt, "
          f"{save_bytes / 2**20:.0f} MiB saved / {load_bytes / 2**20:.0f} MiB loaded a round, "
          f"median of {rounds} rounds, fsync={args.fsync}, disk loads {out['disk_cache']}"
          + (f", disk keyed with a tenant secret ({out['mac']} on every payload)" if args.secret else ""))
    print(f"{'':6} {'save ratio':>10} {'load ratio':>10}   (kvtier GB/s vs plain GB/s)")
    for tier, what in (("cpu", "torch copy"), ("disk", "file I/O")):
        cpu_t = (f"; CPU-time ratios save {out[f'{tier}_save_cpu_time_ratio']}, load "
                 f"{out[f'{tier}_load_cpu_time_ratio']}") if f"{tier}_save_cpu_time_ratio" in out else ""
        print(f"{tier:6} {out[f'{tier}_save_ratio']:>10} {out[f'{tier}_load_ratio']:>10}   "
              f"save {out[f'{tier}_save_gbps']} vs {out[f'{tier}_plain_save_gbps']}, load "
              f"{out[f'{tier}_load_gbps']} vs {out[f'{tier}_plain_load_gbps']} (plain {what}){cpu_t}")
    for op in ("save", "load"):
        if op == "load" and args.secret:  # a keyed load checks the MAC alone
            passes = f"MAC {out['disk_load_mac_ms']} ms (a keyed load checks no checksum)"
        else:
            passes = f"xxh3 {out[f'disk_{op}_xxh3_ms']} ms" + (
                f" + MAC {out[f'disk_{op}_mac_ms']} ms" if args.secret else "")
        print(f"disk {op} limit, serial on one core: plain {out[f'disk_plain_{op}_ms']} ms + {passes} over "
              f"the same bytes: {out[f'disk_{op}_limit_ratio']}; kvtier at {out[f'disk_{op}_of_limit']} of it")
    if args.secret:
        print(f"  the MAC of those pieces already in cache, as a keyed load runs it: "
              f"{out['disk_load_mac_hot_ms']} ms; limit {out['disk_load_limit_hot_ratio']}, kvtier at "
              f"{out['disk_load_of_limit_hot']} of it")
    print(f"checksum {out['checksum']} via {out['checksum_path']}: {out['host_checksum_gbps']} GB/s, memcpy "
          f"{out['host_memcpy_gbps']} GB/s on this host: a two-pass verified load (copy, then checksum) "
          f"could reach at most ~{out['two_pass_load_ratio_bound']} of a plain read on one core")
    print(f"disk reads {out['disk_reads']}: {out['disk_mapped_reads']} resident payloads copied from the mapped "
          "page cache and checksummed in the same pass (the rest: preadv + one checksum pass)")
    print(f"disk pipeline {out['disk_pipeline']}: {out['disk_helper_ios']} payloads moved by the helper thread "
          "(saves: the second of two write lanes; cold loads: pieces read while this thread checksums) "
          "(auto: only while the load average leaves half a core free; the CPU-time ratios above "
          "charge the helper)")
    print(f"lookup of a 131072-token prompt ({out['lookup_prompt_chunks']} chunks x 4 groups): "
          f"{out['lookup_ms_128k']} ms, {out['lookup_chunks_per_s']:.0f} chunks/s; "
          f"hashing it: {out['hash_ms_128k']} ms")
    return 0


def _passes(src: dict, namespace_id: str, keyed: bool) -> dict[str, object]:  # type: ignore[type-arg]
    """The passes over a payload's bytes that the disk tier's verified paths add to plain I/O:
    `xxh3` (the payload checksum: every save, every unkeyed load) and, keyed, `mac` (OpenSSL's
    MAC through `integrity.Keyed`, its per-value key derivation included: every keyed save and
    load). name -> f(key, view); views of the same source tensors the tier saves and loads."""
    from kvtier.store.integrity import Keyed
    from kvtier.store.payload import DEFAULT_CHECKSUM, as_bytes_view, checksum, make_header, seal

    views = {k: as_bytes_view(v) for k, v in src.items()}
    out: dict[str, object] = {"views": views,
                              "xxh3": lambda k: checksum(views[k], DEFAULT_CHECKSUM)}
    if keyed:
        mac = Keyed(os.urandom(32))
        headers = {k: make_header(namespace_id, bytes([k[0], k[1] % 256]) * 16, k[0], 256 * k[1],
                                  256 * (k[1] + 1), len(v)) for k, v in views.items()}
        out["mac"] = lambda k: mac.mac(headers[k], views[k])
        out["signed"] = {k: mac.sign(seal(h, views[k]), views[k]) for k, h in headers.items()}
        out["keyed"] = mac
    return out


def _mac_hot(passes: dict, keys: list) -> float:  # type: ignore[type-arg]
    """Seconds of the MAC of the `keys`' payloads fed piece by piece (MAC_PIECE), each piece
    brought into this core's cache first, untimed: the MAC a keyed load pays after its copy
    (`Keyed.copy_check` MACs each piece from the caller's buffer right after copying it)."""
    import numpy as np

    from kvtier.store.integrity import MAC_PIECE

    keyed, views, signed = passes["keyed"], passes["views"], passes["signed"]
    scratch = np.empty(MAC_PIECE, np.uint8)
    total = 0.0
    for k in keys:
        view, n = views[k], len(views[k])
        t0 = time.perf_counter()
        mac = keyed.stream(signed[k])
        total += time.perf_counter() - t0
        for a in range(0, n, MAC_PIECE):
            piece = view[a:a + MAC_PIECE]
            np.copyto(scratch[:len(piece)], np.frombuffer(piece, np.uint8))  # into L2, untimed
            t0 = time.perf_counter()
            mac.update(piece)
            total += time.perf_counter() - t0
        t0 = time.perf_counter()
        if mac.verdict() is not None:
            raise AssertionError("the bench's own MAC did not verify")
        total += time.perf_counter() - t0
    return total


def _time_passes(passes: dict, op: str, keys: list, r: int, t: dict) -> None:  # type: ignore[type-arg]
    """Time each pass over the `keys`' payloads once (the order flips every round); appended to
    t[f"{op}_{name}"] in seconds."""
    names = [n for n in ("xxh3", "mac") if n in passes]
    for name in (names if r % 2 else names[::-1]):
        f = passes[name]
        t0 = time.perf_counter()
        for k in keys:
            f(k)  # type: ignore[operator]
        t.setdefault(f"{op}_{name}", []).append(time.perf_counter() - t0)


def _limits(med: dict[str, float], ratios: dict[str, float], keyed: bool) -> dict[str, object]:
    """The disk paths' measured serial limit: on one core, a verified path can run at most at
    plain / (plain + the passes it adds over the same bytes), each timed alone in the same rounds
    (`med`: median seconds of plain_save, plain_load, save_xxh3, load_xxh3 and, keyed, save_mac,
    load_mac). A save adds the xxh3 checksum and, keyed, the MAC; an unkeyed load the checksum; a
    keyed load the MAC alone (it covers header and bytes; integrity's docstring). `*_of_limit`:
    the measured ratio over that limit (above 1: the tier beats one core's serial sum, by its
    second write lane or by a pass that rides on the copy)."""
    res: dict[str, object] = {}
    for op in ("save", "load"):
        plain = med[f"plain_{op}"]
        added = [f"{op}_xxh3", f"{op}_mac"] if op == "save" and keyed else (
            [f"{op}_mac"] if keyed else [f"{op}_xxh3"])
        limit = plain / (plain + sum(med[k] for k in added))
        res[f"disk_plain_{op}_ms"] = round(plain * 1e3, 3)
        res[f"disk_{op}_xxh3_ms"] = round(med[f"{op}_xxh3"] * 1e3, 3)
        res[f"disk_{op}_mac_ms"] = round(med[f"{op}_mac"] * 1e3, 3) if keyed else None
        res[f"disk_{op}_limit_ratio"] = round(limit, 3)
        res[f"disk_{op}_of_limit"] = round(ratios[op] / limit, 3)
    if keyed:  # the keyed load's MAC as it runs there: on each piece right after its copy, in cache
        plain, hot = med["plain_load"], med["load_mac_hot"]
        res["disk_load_mac_hot_ms"] = round(hot * 1e3, 3)
        res["disk_load_limit_hot_ratio"] = round(plain / (plain + hot), 3)
        res["disk_load_of_limit_hot"] = round(ratios["load"] * (plain + hot) / plain, 3)
    return res


def _checksum_bound() -> dict[str, object]:
    """This host's memcpy and payload-checksum speeds (thread CPU time, 8 MiB buffers).

    A two-pass verified load is one memcpy (page cache -> buffer) plus one checksum pass over
    the same bytes; the plain read is the memcpy alone. So memcpy / (memcpy + checksum time)
    bounds such a load on one core here. The disk tier's resident loads avoid the second pass
    where the C extension is built (`checksum_path`); its cold loads and every save still pay it."""
    import numpy as np

    from kvtier.store.payload import CHECKSUM_NAMES, DEFAULT_CHECKSUM, checksum, fused_checksum_name

    bufs = [np.random.default_rng(k).integers(0, 256, 8 << 20, dtype=np.uint8) for k in range(8)]
    dst = np.empty(8 << 20, dtype=np.uint8)
    copy_t, sum_t = [], []
    for k in range(24):
        b = bufs[k % len(bufs)]
        c0 = time.thread_time()
        np.copyto(dst, b)
        c1 = time.thread_time()
        checksum(b)
        c2 = time.thread_time()
        copy_t.append(c1 - c0)
        sum_t.append(c2 - c1)
    mc, ck = statistics.median(copy_t), statistics.median(sum_t)
    return {
        "checksum": CHECKSUM_NAMES[DEFAULT_CHECKSUM],
        "checksum_path": fused_checksum_name(),
        "host_memcpy_gbps": round((8 << 20) / mc / 1e9, 1),
        "host_checksum_gbps": round((8 << 20) / ck / 1e9, 1),
        "two_pass_load_ratio_bound": round(mc / (mc + ck), 2),
    }


def _lookup_bench(rounds: int) -> dict[str, object]:
    """Lookup of a fully cached 128k-token prompt; payloads are tiny (lookup never reads them)."""
    from kvtier.core.keys import Namespace, chunk_hashes
    from kvtier.core.plan import make_plan
    from kvtier.store.store import Store

    geom = bench_geometry(small=True)
    plan = make_plan(geom, chunk_tokens=256)
    ns = Namespace("bench-lookup", geom.fingerprint(), "bfloat16")
    tokens = [(31 * i) % 50000 for i in range(131072)]
    hash_times = []
    hashes: list[bytes] = []
    for _ in range(3):
        t0 = time.perf_counter()
        hashes = chunk_hashes(plan, ns, tokens)
        hash_times.append(time.perf_counter() - t0)
    nchunks = len(hashes)
    # an index-sized store: capacity for every chunk of every group, no slab traffic measured
    store = Store(plan, ns, cpu_bytes=(nchunks + 1) * plan.chunk_bytes_all_groups, pin_memory=False, placement="every")
    assert store.index is not None
    for gp in plan.cacheable_groups:
        for i in plan.store_chunks(gp.index, len(tokens)):
            store.index.put(hashes[i], gp.index, "cpu")
    times = []
    for _ in range(max(rounds, 5)):
        t0 = time.perf_counter()
        hit = store.lookup(hashes, len(tokens) + 1)
        times.append(time.perf_counter() - t0)
        assert hit.tokens == nchunks * plan.chunk_tokens
    med = statistics.median(times)
    store.close()
    return {
        "lookup_prompt_chunks": nchunks,
        "lookup_ms_128k": round(med * 1e3, 3),
        "lookup_chunks_per_s": round(nchunks / med),
        "hash_ms_128k": round(statistics.median(hash_times) * 1e3, 2),
    }
