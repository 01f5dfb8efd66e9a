"""The `kvtier.*` keys of vLLM's kv_connector_extra_config: what is accepted, and the one-line
errors (naming the key) that stop an engine from starting misconfigured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import parse_config, parse_size


def test_full_config_is_read(tmp_path: Path) -> None:
    cfg = parse_config({
        "spec_name": "KvtierOffloadingSpec",  # vLLM's keys pass through untouched
        "blocks_per_chunk": 2,
        "kvtier.tiers": "cpu, disk",
        "kvtier.cpu_bytes": "1GiB",
        "kvtier.disk_bytes": 3 * 10**9,
        "kvtier.directory": str(tmp_path),
        "kvtier.policy": "arc",
        "kvtier.share": "equal",
        "kvtier.chunk_tokens": 256,
    })
    assert cfg.tiers == ("cpu", "disk")
    assert cfg.capacities == {"cpu": 1 << 30, "disk": 3 * 10**9}
    assert cfg.directory == str(tmp_path)
    assert (cfg.policy, cfg.share, cfg.chunk_tokens) == ("arc", "equal", 256)


def test_redis_tier() -> None:
    cfg = parse_config({"kvtier.tiers": "cpu,redis", "kvtier.cpu_bytes": "1MiB",
                        "kvtier.redis_bytes": "2GiB", "kvtier.redis_url": "redis://127.0.0.1:6379/0"})
    assert cfg.tiers == ("cpu", "redis")
    assert cfg.capacities == {"cpu": 1 << 20, "redis": 2 << 30}
    assert cfg.redis_url == "redis://127.0.0.1:6379/0"


def test_tenant_salts_the_namespace() -> None:
    from kvtier.core.keys import Namespace

    cfg = parse_config({"kvtier.cpu_bytes": 4096, "kvtier.tenant": "finetune-v2"})
    assert cfg.tenant == "finetune-v2"
    assert parse_config({"kvtier.cpu_bytes": 4096}).tenant == ""
    # different tenants: different namespaces, so no key is shared (new weights, same path)
    a = Namespace("m", "f" * 16, "bfloat16", tenant=cfg.tenant)
    b = Namespace("m", "f" * 16, "bfloat16")
    assert a.id != b.id
    with pytest.raises(ConfigError, match=r"kvtier.tenant=3 must be a string"):
        parse_config({"kvtier.cpu_bytes": 4096, "kvtier.tenant": 3})


def test_defaults_are_one_cpu_tier_auto_policy() -> None:
    cfg = parse_config({"kvtier.cpu_bytes": 4096})
    assert cfg.tiers == ("cpu",)
    assert cfg.capacities == {"cpu": 4096}
    assert (cfg.directory, cfg.policy, cfg.share, cfg.chunk_tokens) == (None, "auto", "auto", None)  # auto: worth where it applies (kvtier.index.tuning)
    assert cfg.placement == "hits"  # store where hits land (docs/admission.md); "every" opts out
    assert parse_config({"kvtier.cpu_bytes": 4096, "kvtier.placement": "every"}).placement == "every"
    with pytest.raises(ConfigError, match=r"kvtier.placement='sometimes' is unknown; use \"hits\""):
        parse_config({"kvtier.cpu_bytes": 4096, "kvtier.placement": "sometimes"})


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5KiB", 1536), ("100", 100), (7, 7),
])
def test_sizes(text: object, expected: int) -> None:
    assert parse_size("kvtier.cpu_bytes", text) == expected


@pytest.mark.parametrize(("extra", "needle"), [
    ({"kvtier.cpu_bytes": 1, "kvtier.cpu_byte": 2}, "kvtier.cpu_byte "),
    ({"kvtier.cpu_bytes": -1}, "kvtier.cpu_bytes=-1"),
    ({"kvtier.cpu_bytes": 0}, "kvtier.cpu_bytes=0"),
    ({"kvtier.cpu_bytes": "lots"}, "kvtier.cpu_bytes='lots'"),
    ({"kvtier.cpu_bytes": True}, "kvtier.cpu_bytes=True"),
    ({"kvtier.tiers": "cpu"}, "kvtier.cpu_bytes is missing"),
    ({"kvtier.tiers": "disk", "kvtier.disk_bytes": "1GiB"}, "kvtier.directory is missing"),
    ({"kvtier.tiers": "tape", "kvtier.cpu_bytes": 1}, "kvtier.tiers"),
    ({"kvtier.tiers": "cpu,cpu", "kvtier.cpu_bytes": 1}, "twice"),
    ({"kvtier.cpu_bytes": 1, "kvtier.disk_bytes": 1}, "kvtier.disk_bytes is set"),
    ({"kvtier.cpu_bytes": 1, "kvtier.policy": "random"}, "kvtier.policy='random'"),
    ({"kvtier.cpu_bytes": 1, "kvtier.share": "row-per-key"}, "kvtier.share"),
    ({"kvtier.cpu_bytes": 1, "kvtier.chunk_tokens": -128}, "kvtier.chunk_tokens=-128"),
    ({"kvtier.cpu_bytes": 1, "kvtier.redis_url": "redis://x"}, "kvtier.redis_url is set"),
    ({"kvtier.tiers": "redis", "kvtier.redis_bytes": "1GiB"}, "kvtier.redis_url is missing"),
    ({"kvtier.tiers": "redis", "kvtier.redis_url": "redis://h:1/0"}, "kvtier.redis_bytes is missing"),
    ({"kvtier.tiers": "redis", "kvtier.redis_bytes": 1, "kvtier.redis_url": "h:1"},
     "kvtier.redis_url='h:1'"),
])
def test_mistakes_name_the_key_in_one_line(extra: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(extra)
    msg = str(err.value)
    assert needle in msg
    assert "\n" not in msg


def test_directory_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"kvtier.directory='.*nope' does not exist"):
        parse_config({"kvtier.tiers": "disk", "kvtier.disk_bytes": "1GiB",
                      "kvtier.directory": str(missing)})


def test_spec_refuses_bad_config_before_touching_the_engine(tmp_path: Path) -> None:
    """The spec vLLM builds at engine start raises the same one-line error."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier.integrations.vllm.spec import KvtierOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(128, ("model.layers.0.self_attn.attn",), 0),),
        worker_kv_bytes_per_block=1024,
        enable_kv_cache_events=False,
        extra_config={"kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "1GiB",
                      "kvtier.disk_bytes": "1GiB", "kvtier.directory": str(tmp_path / "absent")},
        engine_id="e",
        model=OffloadingModelConfig(name=str(tmp_path), dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    with pytest.raises(ConfigError, match="kvtier.directory="):
        KvtierOffloadingSpec(config)


@pytest.mark.parametrize("sizes, setting", [((2, 1, 1), "pipeline_parallel_size=2"),
                                            ((1, 1, 2), "decode_context_parallel_size=2"),
                                            ((1, 4, 1), "prefill_context_parallel_size=4")])
def test_spec_refuses_split_kv_layouts_by_their_setting(tmp_path: Path, sizes, setting) -> None:
    """Pipeline stages and context parallel split a request's KV in ways kvtier does not describe:
    refused at start by the setting's name (it was a byte-size mismatch in the worker)."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    from kvtier.integrations.vllm.spec import KvtierOffloadingSpec

    pp, pcp, dcp = sizes
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(128, ("model.layers.0.self_attn.attn",), 0),),
        worker_kv_bytes_per_block=1024, enable_kv_cache_events=False,
        extra_config={"kvtier.tiers": "cpu", "kvtier.cpu_bytes": "1GiB"}, engine_id="e-par",
        model=OffloadingModelConfig(name=str(tmp_path), dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, pp * pcp * dcp, 1, pp, pcp, dcp, 0, 1, None, True),
    )
    with pytest.raises(ConfigError, match=f"^{setting}: kvtier does not offload KV split") as err:
        KvtierOffloadingSpec(config)
    assert "\n" not in str(err.value) and "=1" in str(err.value)


def test_falcon_h1_layers_map_to_groups_by_name(tmp_path: Path, config_path) -> None:
    """Falcon-H1 runs an attention and an SSM branch in every layer; vLLM names the SSM branch of
    layer i `model.{L + i}.mixer`. Each vLLM group maps to kvtier's group of its own kind (the
    spec stopped at start: layers were matched by index only)."""
    import json
    import shutil

    from kvtier.integrations.vllm.engine_groups import EngineGroup, geometry_for_groups

    shutil.copy(config_path("falcon-h1-0.5b"), tmp_path / "config.json")
    n = json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"]
    attn = tuple(f"model.layers.{i}.self_attn.attn" for i in range(n))
    ssm = tuple(f"model.{n + i}.mixer" for i in range(n))
    geometry = geometry_for_groups(str(tmp_path), "bfloat16",
                                   [EngineGroup(0, 16, attn), EngineGroup(1, 16, ssm)], 16)
    assert [g.kind for g in geometry.groups] == ["full", "state"]
    assert [g.layers for g in geometry.groups] == [tuple(range(n)), tuple(range(n))]
    assert geometry.groups[1].state_bytes_per_layer > 0


def test_a_redis_url_with_a_password_is_refused_without_echoing_it() -> None:
    """vLLM logs kv_transfer_config verbatim at start: a password there ends up in the log."""
    with pytest.raises(ConfigError) as err:
        parse_config({"kvtier.tiers": "redis", "kvtier.redis_bytes": "1GiB",
                      "kvtier.redis_url": "redis://app:s3cret@10.0.0.5:6379/0"})
    msg = str(err.value)
    assert "s3cret" not in msg and "\n" not in msg
    assert "kvtier.redis_password_file" in msg and "KVTIER_REDIS_PASSWORD" in msg


def test_the_redis_password_comes_from_a_private_file_or_the_environment(tmp_path: Path, monkeypatch) -> None:
    from kvtier.integrations.vllm.config import redis_password

    base = {"kvtier.tiers": "redis", "kvtier.redis_bytes": "1GiB", "kvtier.redis_url": "redis://10.0.0.5:6379/0"}
    secret = tmp_path / "redis.pw"
    secret.write_text("s3cret\n")
    os.chmod(secret, 0o644)
    with pytest.raises(ConfigError, match=r"readable by others \(mode 644\); run `chmod 600"):
        parse_config({**base, "kvtier.redis_password_file": str(secret)})
    os.chmod(secret, 0o600)
    cfg = parse_config({**base, "kvtier.redis_password_file": str(secret)})
    assert "s3cret" not in repr(cfg)  # the config value holds the path only
    assert redis_password(cfg) == "s3cret"
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "from-env")
    assert redis_password(parse_config(base)) == "from-env"
    monkeypatch.delenv("KVTIER_REDIS_PASSWORD")
    assert redis_password(parse_config(base)) is None


def test_the_vllm_path_reaches_a_password_protected_redis(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("redis")
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from redis_servers import have_redis, redis_server

    if not have_redis():
        pytest.fail("redis-server is not installed; `make test` installs it (scripts/ensure-redis.sh)")
    from kvtier.integrations.vllm.config import redis_password
    from kvtier.store.payload import make_header
    from kvtier.store.tiers.redis import RedisTier

    secret = tmp_path / "redis.pw"
    secret.write_text("pw-123\n")
    os.chmod(secret, 0o600)
    with redis_server(password="pw-123") as srv:
        cfg = parse_config({"kvtier.tiers": "redis", "kvtier.redis_bytes": "1GiB",
                            "kvtier.redis_url": srv.url, "kvtier.redis_password_file": str(secret)})
        tier = RedisTier.from_url(cfg.redis_url, namespace_id="00112233aabbccdd", password=redis_password(cfg))
        try:
            h = make_header("00112233aabbccdd", b"\x07" * 16, 0, 0, 16, 64)
            data = torch.arange(64, dtype=torch.uint8)
            assert tier.write(0, 0, h, data)
            out = torch.zeros(64, dtype=torch.uint8)
            assert tier.read(0, 0, h, out) and torch.equal(out, data)
        finally:
            tier.close()


def test_metrics_files_of_exited_processes_are_removed(tmp_path: Path) -> None:
    """`metrics/` held one file per process id forever; a new process removes the files of
    processes that have exited and keeps live ones."""
    import subprocess
    import sys

    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.counters import Metrics, read_metrics

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / f"worker0-{dead}.json").write_text('{"counts": {"x": 1}}')
    (tmp_path / "metrics" / f"scheduler-{os.getppid()}.json").write_text('{"counts": {"y": 2}}')
    m = Metrics("scheduler", str(tmp_path))
    m.add("resets")
    m.flush(force=True)
    names = sorted(p.name for p in (tmp_path / "metrics").iterdir())
    assert names == sorted([f"scheduler-{os.getppid()}.json", f"scheduler-{os.getpid()}.json"])
    assert read_metrics(tmp_path) == {"y": 2, "resets": 1}


def test_every_group_vllm_offloads_is_cacheable_in_its_plan() -> None:
    """vLLM decides which groups a hit needs; a group kvtier declined would answer MISS for every
    key and veto every hit of the model. A state group's chunk in vLLM is blocks_per_chunk pages."""
    from kvtier.core.geometry import Geometry, Group
    from kvtier.integrations.vllm.engine_plan import engine_plan

    geometry = Geometry(groups=(
        Group(name="full", kind="full", num_layers=2, tokens_per_block=16, bytes_per_token_per_layer=256,
              dtype="float32"),
        Group(name="swa1", kind="sliding", num_layers=1, tokens_per_block=16, bytes_per_token_per_layer=256,
              window=1, dtype="float32", cacheable=False, reason="declined"),
        Group(name="gdn", kind="state", num_layers=3, tokens_per_block=16, state_bytes_per_layer=4096,
              dtype="uint8"),
    ), tokens_per_hash=16)
    plan, spans = engine_plan(geometry, 4)
    assert [gp.cacheable for gp in plan.groups] == [True, True, True]
    assert spans == (64, 64, 64)
    assert [gp.chunk_bytes for gp in plan.groups] == [64 * 512, 64 * 256, 4 * 3 * 4096]


def test_the_redis_password_file_is_checked_on_its_descriptor(tmp_path: Path) -> None:
    """The password file gets the secret file's checks (store/integrity.read_private_file): a
    symlink to a good 0600 file, another user's file and a character device are refused at start."""
    base = {"kvtier.tiers": "redis", "kvtier.redis_bytes": "1GiB", "kvtier.redis_url": "redis://10.0.0.5:6379/0"}
    pw = tmp_path / "redis.pw"
    pw.write_text("s3cret\n")
    os.chmod(pw, 0o600)
    link = tmp_path / "link.pw"
    link.symlink_to(pw)
    theirs = tmp_path / "theirs.pw"
    theirs.write_text("s3cret\n")
    os.chmod(theirs, 0o600)
    os.chown(theirs, 12345, -1)  # we are root here
    for path, match in ((link, "symbolic link"), (theirs, "owned by uid 12345"), ("/dev/zero", "not a regular file")):
        with pytest.raises(ConfigError, match=match) as err:
            parse_config({**base, "kvtier.redis_password_file": str(path)})
        assert "kvtier.redis_password_file" in str(err.value) and "s3cret" not in str(err.value)
    assert parse_config({**base, "kvtier.redis_password_file": str(pw)}).redis_password_file == str(pw)


@pytest.mark.parametrize("url", [
    "redis://10.0.0.5:6379/0?password=s3cret",
    "redis://10.0.0.5:6379/0?db=0&ssl_password=s3cret",
    "redis://10.0.0.5:6379/0?pass%77ord=s3cret",  # redis-py decodes the name: still a password
    "redis+sentinel://10.0.0.7:26379/svc?password=s3cret",
])
def test_a_redis_url_with_a_password_in_its_query_is_refused_without_echoing_it(url: str) -> None:
    """redis-py reads `?password=` as the password (over the userinfo's): it was accepted, used,
    and logged by vLLM with its kv_transfer_config."""
    with pytest.raises(ConfigError) as err:
        parse_config({"kvtier.tiers": "redis", "kvtier.redis_bytes": "1GiB", "kvtier.redis_url": url})
    msg = str(err.value)
    assert "s3cret" not in msg and "\n" not in msg, msg
    assert "kvtier.redis_password_file" in msg and "KVTIER_REDIS_PASSWORD" in msg


def test_a_redis_url_that_is_no_url_is_not_echoed_with_its_credentials() -> None:
    with pytest.raises(ConfigError, match="must be a URL") as err:
        parse_config({"kvtier.tiers": "redis", "kvtier.redis_bytes": "1GiB",
                      "kvtier.redis_url": "app:s3cret@10.0.0.5:6379"})
    assert "s3cret" not in str(err.value)


def test_the_environments_secret_is_read_only_for_tiers_that_seal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only disk and Redis payloads carry the MAC: a cpu-only engine starts whatever the
    environment's KVTIER_SECRET_FILE holds; with a disk tier the bad file is refused at start."""
    bad = tmp_path / "secret"
    bad.write_bytes(b"short")
    bad.chmod(0o600)
    monkeypatch.setenv("KVTIER_SECRET_FILE", str(bad))
    assert parse_config({"kvtier.cpu_bytes": 4096}).keyed is None
    with pytest.raises(ConfigError):
        parse_config({"kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": 4096, "kvtier.disk_bytes": 1 << 20,
                      "kvtier.directory": str(tmp_path / "kv")})
