"""The `kvtier.*` keys of vLLM's `kv_connector_extra_config`, parsed once at engine start.

vLLM hands every key of `kv_connector_extra_config` to the offloading spec; the keys that start
with `kvtier.` are ours and are checked here, strictly: an unknown `kvtier.` key, a negative or
unreadable size, a tier without its size, a disk tier without an existing directory all raise
`ConfigError` with one line naming the key, so a misconfigured engine fails at start instead of
serving without its cache. Keys without the prefix (`spec_name`, `blocks_per_chunk`, ...) are
vLLM's and are left to it.

| key | meaning | default |
| --- | --- | --- |
| `kvtier.tiers` | tiers, fastest first: `"cpu"`, `"disk"`, `"redis"`, `"cpu,disk,redis"` (or a list) | `"cpu"` |
| `kvtier.cpu_bytes` | host-memory tier capacity (int bytes or `"4GiB"`, `"512MiB"`) | required with cpu |
| `kvtier.disk_bytes` | disk tier capacity | required with disk |
| `kvtier.directory` | existing directory: disk slabs and the metrics file | required with disk |
| `kvtier.policy` | eviction policy: `auto` (`worth` where placement `hits` places a cacheable group other than full/MLA, else `lru`), `worth` (LRU plus the compute an entry saves, its weight tuned online; `worth:w=W` fixes it), `lru`, `fifo`, `arc`, `s3fifo` | `"auto"` |
| `kvtier.placement` | `hits`: full-attention chunks every time, a state checkpoint or sliding window only where hits land (docs/admission.md), the rest to a later tier (disk, Redis) or not at all; `every`: every chunk to every tier | `"hits"` |
| `kvtier.share` | how a tier's bytes are shared by groups (`auto`: `learned` where it applies, else the placement's fixed rule; `learned`: moved toward the groups' warm bytes as traffic goes, on the cpu tier, where the engine runs on CPU (docs/vllm.md, "The learned share"); `proportional`, `equal`) | `"auto"` |
| `kvtier.chunk_tokens` | tokens per chunk (a multiple of vLLM's block size) | vLLM's blocks_per_chunk |
| `kvtier.redis_bytes` | bytes of this namespace the index tracks in Redis (Redis's maxmemory is the real bound) | required with redis |
| `kvtier.redis_url` | `redis://host:port/db`, `rediss://`, `redis+cluster://`, `redis+sentinel://`; never with a password in it, in the userinfo or the query (`?password=`): vLLM logs this config | required with redis |
| `kvtier.secret_file` | a file (mode 0600, at least 16 bytes) holding the tenant secret that MACs every disk and Redis payload; or set `KVTIER_SECRET_FILE` / `KVTIER_SECRET` in the engine's environment | none |
| `kvtier.accept_legacy_macs` | with a secret, also restore values MACed by older kvtier (keyed BLAKE2b/BLAKE3, format 2); set `false` once those have expired (docs/store.md, "Threat model") | `true` |
| `kvtier.redis_password_file` | a file (mode 0600) holding the Redis password; or set `KVTIER_REDIS_PASSWORD` in the engine's environment | none |
| `kvtier.io_queue_bytes` | disk and Redis writes that may wait for the worker's background I/O thread; a store past it skips those tiers (counted `store_dropped_<tier>`), never waits | `"256MiB"` |
| `kvtier.host_region` | where the cpu tier's slabs live so the scheduler's process can fill them too (promotion at lookup, promotion.py): `"auto"` (a private file in /dev/shm), an existing directory, or `"off"` (private memory of the worker: promotion at load only) | `"auto"` |
| `kvtier.tenant` | a salt mixed into every key: engines with different tenants share nothing. Change it when the weights change under the same model path (a new fine-tune, a new revision): kvtier's namespace sees the path, config and dtype, not the weights | `""` |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.core.counters import TIERS  # the tier names, declared once
from kvtier.core.units import parse_bytes

PREFIX = "kvtier."
KEYS = ("tiers", "cpu_bytes", "disk_bytes", "redis_bytes", "directory", "policy", "share", "placement",
        "chunk_tokens", "redis_url", "redis_password_file", "secret_file", "tenant", "io_queue_bytes", "host_region",
        "accept_legacy_macs")
IO_QUEUE_BYTES = 256 << 20  # disk/Redis writes waiting for the background lane, per worker
PASSWORD_ENV = "KVTIER_REDIS_PASSWORD"
PLACEMENTS = ("hits", "every")  # kvtier.store.store.PLACEMENTS (not imported: no torch here)
SHARES = ("auto", "learned", "proportional", "equal")
WORTH_OPTIONS = ("w", "max_chunks", "period")  # kvtier.policy "worth:w=W,max_chunks=N,period=N"


@dataclass(frozen=True, slots=True)
class VllmTierConfig:
    """kvtier's settings inside one vLLM engine (both the scheduler and the workers parse them)."""

    tiers: tuple[str, ...]
    capacities_bytes: tuple[tuple[str, int], ...]  # (tier, bytes), fastest first
    directory: str | None
    policy: str  # "auto": worth where it applies, else lru (SpecContext.policy)
    share: str  # "auto": learned where it applies, else the placement's (SpecContext.share)
    chunk_tokens: int | None
    redis_url: str | None = None
    tenant: str = ""
    redis_password_file: str | None = None  # the path only: the password is read when connecting
    secret_file: str | None = None  # the path (the secret itself is `keyed`, never a logged value)
    accept_legacy_macs: bool = True  # integrity.Keyed: False restores current-format MACs only
    io_queue_bytes: int = IO_QUEUE_BYTES
    host_region: str = "auto"  # "auto", "off", or a directory (kvtier.host_region)
    # vLLM 0.33's sync_load_budget_bytes is set: every hit is served from the cpu tier only
    # (host_only.py), so no load, synchronous or not, reads disk or Redis
    host_only_loads: bool = False
    placement: str = "hits"  # kvtier.placement: "hits" or "every"
    # the tenant secret (integrity.Keyed, or None), read once by parse_config (integrity.load_secret)
    # and handed to every tier of this process; no repr, not compared
    keyed: object = field(default=None, repr=False, compare=False)

    @property
    def host_region_dir(self) -> str | None:
        """The directory of the cpu tier's host region file, or None ("off")."""
        return None if self.host_region == "off" else "/dev/shm" if self.host_region == "auto" else self.host_region

    @property
    def capacities(self) -> dict[str, int]:
        return dict(self.capacities_bytes)


def parse_size(key: str, value: object) -> int:
    """Bytes from an int or a string such as `"4GiB"`; a ConfigError naming `key` otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a byte count; give e.g. 4294967296 or \"4GiB\"")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and (parsed := parse_bytes(value)) is not None:
        n = parsed
    else:
        raise ConfigError(
            f"{key}={value!r} is not a byte count; give an integer or a size like \"512MiB\", \"4GiB\""
        )
    if n <= 0:
        raise ConfigError(f"{key}={value!r}: a tier size must be a positive byte count, e.g. \"4GiB\"")
    return n


def parse_config(extra_config: Mapping[str, object]) -> VllmTierConfig:
    """Check and read the `kvtier.` keys of a `kv_connector_extra_config` mapping."""
    ours = {k[len(PREFIX):]: v for k, v in extra_config.items() if k.startswith(PREFIX)}
    unknown = sorted(k for k in ours if k not in KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key {PREFIX}{unknown[0]} in kv_connector_extra_config; kvtier keys are: "
            + ", ".join(PREFIX + k for k in KEYS)
        )
    tiers = _tiers(ours.get("tiers", "cpu"))
    redis_url = ours.get("redis_url")
    if redis_url is not None and (not isinstance(redis_url, str) or "://" not in redis_url):
        from kvtier.store.tiers.redis_conn import redact

        shown = repr(redact(redis_url)) if isinstance(redis_url, str) else f"a {type(redis_url).__name__}"
        raise ConfigError(f"kvtier.redis_url={shown} must be a URL like \"redis://host:6379/0\"")
    if "redis" in tiers and redis_url is None:
        raise ConfigError("kvtier.redis_url is missing: the redis tier needs a server, e.g. "
                          "\"redis://127.0.0.1:6379/0\"")
    if redis_url is not None and (where := _credentials(redis_url)):
        from kvtier.store.tiers.redis_conn import redact

        raise ConfigError(
            f"kvtier.redis_url={redact(redis_url)!r} carries a password ({', '.join(where)}), and vLLM logs "
            "kv_transfer_config at start; drop it from the URL and put it in a file named by "
            f"kvtier.redis_password_file (mode 0600) or in the environment variable {PASSWORD_ENV}")
    password_file = ours.get("redis_password_file")
    if password_file is not None:
        _private_file(password_file, "kvtier.redis_password_file")  # refused at start, not at connect
    secret_file = ours.get("secret_file")
    if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
        raise ConfigError(f"kvtier.secret_file={secret_file!r} must be a path to a file")
    accept_legacy = ours.get("accept_legacy_macs", True)
    if not isinstance(accept_legacy, bool):
        raise ConfigError(f"kvtier.accept_legacy_macs={accept_legacy!r} must be true or false")
    from kvtier.store.integrity import load_secret  # no torch

    # read once, here, at start; handed to every tier this process opens (`tier_secret`). Only the
    # disk and Redis tiers seal payloads: a cpu-only engine ignores the environment's secret unless
    # told to refuse unkeyed payloads (accept_legacy_macs false needs a secret wherever it runs)
    keyed = None
    if secret_file is not None or not accept_legacy or {"disk", "redis"} & set(tiers):
        keyed = load_secret(secret_file=secret_file, what="kvtier.secret_file", accept_legacy_macs=accept_legacy,
                            missing="kvtier.accept_legacy_macs=false needs a secret: set kvtier.secret_file (a "
                                    "file of this user, mode 0600), or KVTIER_SECRET_FILE / KVTIER_SECRET in the "
                                    "environment")
    if redis_url is not None and "redis" not in tiers:
        raise ConfigError(f"kvtier.redis_url is set but tier 'redis' is not in kvtier.tiers {list(tiers)}; "
                          "add it to kvtier.tiers or drop the URL")
    capacities: list[tuple[str, int]] = []
    for tier in tiers:
        key = f"{PREFIX}{tier}_bytes"
        if f"{tier}_bytes" not in ours:
            raise ConfigError(f"{key} is missing: tier {tier!r} needs a capacity, e.g. \"{key}\": \"4GiB\"")
        capacities.append((tier, parse_size(key, ours[f"{tier}_bytes"])))
    for tier in TIERS:
        if tier not in tiers and f"{tier}_bytes" in ours:
            raise ConfigError(
                f"{PREFIX}{tier}_bytes is set but tier {tier!r} is not in kvtier.tiers {list(tiers)}; "
                f"add it to kvtier.tiers or drop the size"
            )
    directory = ours.get("directory")
    if directory is not None:
        if not isinstance(directory, str) or not directory:
            raise ConfigError(f"kvtier.directory={directory!r} must be a path (a non-empty string)")
        if not os.path.isdir(directory):
            raise ConfigError(
                f"kvtier.directory={directory!r} does not exist or is not a directory; create it first"
            )
    elif "disk" in tiers:
        raise ConfigError("kvtier.directory is missing: the disk tier needs an existing directory")
    policy = _policy(ours.get("policy", "auto"))
    share = ours.get("share", "auto")
    if share not in SHARES:
        raise ConfigError(f"kvtier.share={share!r} is unknown; use one of: {', '.join(SHARES)}")
    placement = ours.get("placement", "hits")
    if placement not in PLACEMENTS:
        raise ConfigError(f"kvtier.placement={placement!r} is unknown; use \"hits\" (store where hits land) "
                          "or \"every\" (every chunk)")
    chunk_tokens = ours.get("chunk_tokens")
    if chunk_tokens is not None and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0
    ):
        raise ConfigError(f"kvtier.chunk_tokens={chunk_tokens!r} must be a positive integer")
    io_queue = parse_size("kvtier.io_queue_bytes", ours.get("io_queue_bytes", IO_QUEUE_BYTES))
    tenant = ours.get("tenant", "")
    if not isinstance(tenant, str):
        raise ConfigError(f"kvtier.tenant={tenant!r} must be a string, e.g. \"finetune-2026-11\"")
    host_region = ours.get("host_region", "auto")
    if not isinstance(host_region, str) or not host_region:
        raise ConfigError(f"kvtier.host_region={host_region!r} must be \"auto\", \"off\" or a directory")
    if host_region not in ("auto", "off") and not os.path.isdir(host_region):
        raise ConfigError(f"kvtier.host_region={host_region!r} is not a directory; create it, or use "
                          "\"auto\" (/dev/shm) or \"off\"")
    host_only = _sync_loads(extra_config, tiers)
    return VllmTierConfig(
        tiers=tiers,
        capacities_bytes=tuple(capacities),
        directory=directory,
        policy=policy,
        share=str(share),
        chunk_tokens=chunk_tokens,
        redis_url=redis_url,
        tenant=tenant,
        redis_password_file=password_file,
        io_queue_bytes=io_queue,
        secret_file=secret_file,
        keyed=keyed,
        accept_legacy_macs=accept_legacy,
        host_region=host_region,
        host_only_loads=host_only,
        placement=str(placement),
    )


def _sync_loads(extra: Mapping[str, object], tiers: tuple[str, ...]) -> bool:
    """Whether vLLM 0.33's synchronous loads are on (`sync_load_budget_bytes` > 0). vLLM runs a
    request on its synchronously loaded KV in the same step and cannot hear that such a load
    failed (failures are reported per block id, refused for models with several KV-cache groups),
    so kvtier then serves hits from verified host memory only: a chunk on disk or in Redis is
    promoted into the cpu tier at lookup first, or is a miss. That needs the cpu tier first (and,
    at run time, the worker's host region, through which the scheduler checks each slot)."""
    budget = extra.get("sync_load_budget_bytes")
    if budget is None:
        return False
    try:  # as vLLM reads it: int(value)
        if isinstance(budget, bool) or (isinstance(budget, float) and not budget.is_integer()):
            raise ValueError
        n = int(budget)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ConfigError(f"sync_load_budget_bytes={budget!r} must be an integer byte count (vLLM's key), "
                          "e.g. 268435456") from None
    if n <= 0:
        return False
    if tiers[0] != "cpu":
        raise ConfigError(f"sync_load_budget_bytes={budget!r} needs kvtier's cpu tier first (synchronous loads "
                          f"read host memory only) but kvtier.tiers is {','.join(tiers)!r}; put cpu first in "
                          "kvtier.tiers or remove sync_load_budget_bytes")
    return True


def _credentials(url: str) -> list[str]:
    """Where `url` carries a password: in its userinfo (`user:pass@`) or in its query
    (`?password=`, which redis-py reads as the password too); names only, never the values."""
    from kvtier.store.tiers.redis_conn import url_credentials  # no redis-py, no torch

    return url_credentials(url)


def _private_file(path: object, key: str) -> bytes:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}={path!r} must be a path to a file")
    from kvtier.store.integrity import read_private_file  # no torch

    return read_private_file(path, key)


def redis_password(config: VllmTierConfig) -> str | None:
    """The Redis password: from `kvtier.redis_password_file`, else `KVTIER_REDIS_PASSWORD`, else
    None. Read when the tier connects, never kept in a config value vLLM logs."""
    if config.redis_password_file is not None:
        return _private_file(config.redis_password_file, "kvtier.redis_password_file").decode()
    return os.environ.get(PASSWORD_ENV) or None


def _policy(value: object) -> str:
    """`kvtier.policy`, checked: "auto", a POLICIES name, or "worth" with its options (resolved
    against the plan by SpecContext.policy: auto needs the groups and the placement)."""
    from kvtier.index.policies import POLICIES, policy_options  # control plane, no torch

    names = ("auto", *POLICIES, "worth", "worth:w=W")
    if not isinstance(value, str) or (value not in POLICIES and value != "auto"
                                      and value.partition(":")[0] != "worth"):
        raise ConfigError(f"kvtier.policy={value!r} is unknown; use one of: {', '.join(names)}")
    if value.partition(":")[0] == "worth":
        try:
            policy_options(value, "worth", WORTH_OPTIONS, "w", "worth takes w=W (fixed, no tuning), "
                           "max_chunks=N, period=N")
        except ConfigError as exc:
            raise ConfigError(f"kvtier.{exc}") from None
    return value


def _tiers(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        names = [t.strip() for t in value.split(",") if t.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        names = [t.strip() for t in value]
    else:
        raise ConfigError(f"kvtier.tiers={value!r} must be a string like \"cpu,disk\" or a list of names")
    if not names:
        raise ConfigError("kvtier.tiers is empty; give at least one of: " + ", ".join(TIERS))
    for t in names:
        if t not in TIERS:
            raise ConfigError(f"kvtier.tiers names unknown tier {t!r}; use: {', '.join(TIERS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"kvtier.tiers={value!r} names a tier twice")
    return tuple(names)


def tier_secret(config: VllmTierConfig):  # -> Keyed | None (kvtier.store.integrity, no torch)
    """The tenant secret for payload MACs (`kvtier.secret_file`, else the environment), as
    parse_config read it at start (integrity.load_secret): not read again per tier or rank."""
    return config.keyed
