"""Engine-less vLLM harness: vLLM's real `Scheduler` and both halves of `KvtierConnector`
(SCHEDULER and WORKER roles) on CPU tensors, no model weights, no CUDA.

Run as a script, once per vLLM version (the test puts vLLM 0.33's Python files first on
PYTHONPATH for 0.33; see scripts/setup-vllm033.sh):

    python harness.py '[{"name": ..., ...}, ...]'   ->   one line `RESULT {"name": {...}, ...}`

Each scenario builds a fresh engine config from a tiny config.json (written here, only its layer
types and sizes matter), one attention spec per layer as vLLM's Gemma 3 layers would build it, and
vLLM's own KV-cache grouping. A fake forward writes each scheduled token's KV as
f(token id, position, layer) into its block, so every byte a later request loads can be checked:
request A computes and stores a prompt, vLLM's own prefix cache is reset and the KV tensors are
zeroed, then request B with the same prefix loads what kvtier stored, and every loaded position of
every group is compared with what A's forward wrote.

Scenario keys: name; layers (list of "full"/"sliding"/"mla", or dicts {"kind", "block_size",
"heads", "head_size", "window", "name"} for groups with their own tokens per block; kind "state"
is a GDN/Mamba layer with {"conv", "ssm"} state shapes); mamba_cache_mode (default "align");
draft_layers (layer indices whose groups vLLM marks as an EAGLE/MTP drafter's); kv_bytes and
max_model_len (a small GPU cache, so requests preempt each other); window;
block_size (the scheduler's hash block); prompt_tokens;
b_extra_tokens (B = A's prompt + this many new tokens); trace (run_multi_turn: sessions of that
Mooncake trace, once per kvtier.placement); extra (merged into
kv_connector_extra_config); fail_reads ("load": every tier read fails after A); partial (run
the partial-chunk worker check instead of the two requests); lookups (N distinct keys looked up
through the manager: its per-key maps must stay bounded); lifecycle ("abort_load", "reset_load",
"reset_store", "repeat_store", "preempt_store": transfers held in flight across steps, as on a
GPU).
This is a test helper, not kvtier code: it imports vLLM internals that move between releases.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _steps(limit_s: float = 60.0):  # type: ignore[no-untyped-def]
    """Iterations of a step loop until `limit_s` has passed: a wall-clock bound, not a step count
    (500 steps of 10 ms gave a loaded machine's I/O thread 5 s)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        yield


def write_config(directory: str, layers: list[str], window: int) -> str:
    """A Gemma 3-shaped config.json (no weights, no tokenizer): kvtier reads its geometry from
    it, vLLM its engine config."""
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "float32",
        "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": len(layers), "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "sliding_window": window, "max_position_embeddings": 4096,
        "layer_types": [f"{k}_attention" for k in layers], "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 32, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


class Harness:
    def __init__(self, sc: dict) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.utils.hashing import sha256

        self.torch = torch
        self.tmp = tempfile.mkdtemp(prefix="kvtier-harness-")
        self.bs = bs = int(sc.get("block_size", 16))
        layers = sc.get("layers", ["sliding", "sliding", "full", "sliding"])
        window = int(sc.get("window", 48))
        kinds = [(x if isinstance(x, str) else x["kind"]) for x in layers]
        model = write_config(os.path.join(self.tmp, "model"),
                             ["sliding" if k == "sliding" else "full" for k in kinds], window)
        extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm.spec",
                 "kvtier.tiers": "cpu", "kvtier.cpu_bytes": "16MiB", "kvtier.directory": self.tmp}
        extra.update(sc.get("extra", {}))
        extra = {k: v for k, v in extra.items() if v is not None}  # None: drop a default key
        if extra.get("kvtier.secret_file") == "@secret":  # a tenant secret file made here, 0600
            path = os.path.join(self.tmp, "secret")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, os.urandom(32))
            os.close(fd)
            extra["kvtier.secret_file"] = path
        ktc = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        if sc.get("ktc"):  # another connector config wholesale (scripts/gpu-check.py: vLLM's native)
            ktc = sc["ktc"]
        if sc.get("dsv4"):  # DeepSeek V4: the specs vLLM's own DeepSeek-V4 layer classes build
            self._init_dsv4(sc, ktc)
            return
        args = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=int(sc.get("max_model_len", 2048)), enforce_eager=True,
                          block_size=bs, dtype="float32", enable_prefix_caching=True,
                          kv_transfer_config=ktc)
        vconf = args.create_engine_config()
        self.mamba_mode = mode = sc.get("mamba_cache_mode", "align")
        if any(not isinstance(x, str) and x["kind"] == "state" for x in layers):
            vconf.cache_config.mamba_cache_mode = mode
        if vconf.cache_config.kv_cache_layout is None:
            vconf.cache_config.kv_cache_layout = "LBHNC"
        self.specs, self.shape = {}, {}
        for i, layer in enumerate(layers):
            d = {"kind": layer} if isinstance(layer, str) else dict(layer)
            kind, lbs = d["kind"], int(d.get("block_size", bs))
            heads, head = int(d.get("heads", 2)), int(d.get("head_size", 32))
            if kind == "state":  # a GDN/Mamba layer: one state per block, (conv, ssm) float32
                conv, ssm = tuple(d.get("conv", (4, 128))), tuple(d.get("ssm", (2, 16, 48)))
                spec = MambaSpec(block_size=lbs, shapes=(conv, ssm), dtypes=(torch.float32, torch.float32),
                                 mamba_cache_mode=mode)
                self.shape[i] = ("state", spec.page_size_bytes // 4)
                self.specs[d.get("name", f"model.layers.{i}.linear_attn")] = spec
                continue
            if kind == "mla":
                spec = MLAAttentionSpec(block_size=lbs, num_kv_heads=1, head_size=head, dtype=torch.float32)
                self.shape[i] = (1, lbs, head)  # one latent vector per token
            else:
                common = dict(block_size=lbs, num_kv_heads=heads, head_size=head, dtype=torch.float32)
                if kind == "sliding":
                    spec = SlidingWindowSpec(sliding_window=int(d.get("window", window)), **common)
                elif kind == "chunked":  # Llama-4-style chunked local attention
                    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec
                    spec = ChunkedLocalAttentionSpec(attention_chunk_size=int(d["chunk"]), **common)
                else:
                    spec = FullAttentionSpec(**common)
                self.shape[i] = (2, lbs, heads * head)  # K and V
            self.specs[d.get("name", f"model.layers.{i}.self_attn.attn")] = spec
        self._finish_init(sc, vconf, int(sc.get("kv_bytes", 64 << 20)))

    def _init_dsv4(self, sc: dict, ktc: dict) -> None:
        import dsv4_specs

        directory = dsv4_specs.write_config(os.path.join(self.tmp, "dsv4"), mtp=1)
        if sc.get("from_plan"):  # start from the config `kvtier plan DIR --engine vllm` prints
            self.printed = _printed_transfer_config(directory)
            keep = {k: v for k, v in ktc["kv_connector_extra_config"].items()
                    if k in ("kvtier.directory", "kvtier.cpu_bytes")}  # the host memory it may use
            ktc = dict(self.printed, kv_connector_extra_config={**self.printed["kv_connector_extra_config"], **keep})
        _, self.specs, vconf, _ = dsv4_specs.build(sc["dsv4"], mtp=bool(sc.get("mtp", True)),
                                                   directory=directory, kv_transfer_config=ktc)
        # every DeepSeek-V4 cache is an opaque page per block: its real (unpadded) bytes
        self.shape = {i: ("page", int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes)))
                      for i, spec in enumerate(self.specs.values())}
        self._finish_init(sc, vconf, int(sc.get("kv_bytes", 256 << 20)))

    def _finish_init(self, sc: dict, vconf, kv_bytes: int) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.utils.hashing import sha256

        try:
            from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
            groups = get_global_kv_cache_groups(vconf, [self.specs])
            kvc = get_kv_cache_configs(vconf, [self.specs], [kv_bytes], groups)[0]
        except ImportError:  # vLLM 0.32
            from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
            kvc = get_kv_cache_configs(vconf, [self.specs], [kv_bytes])[0]
        kvc.kv_cache_layout = vconf.cache_config.kv_cache_layout
        draft = {list(self.specs)[i] for i in sc.get("draft_layers", ())}
        for group in kvc.kv_cache_groups:  # as vLLM marks an EAGLE/MTP drafter's groups
            if draft & set(group.layer_names):
                group.is_eagle_group = True
        vconf.cache_config.num_gpu_blocks = kvc.num_blocks
        self.kvc, self.vconf = kvc, vconf
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        sched_bs, self.hash_bs = resolve_kv_cache_block_sizes(kvc, vconf)  # lcm and gcd of the groups'
        try:  # the scheduler gets one representative spec per group, as EngineCore gives it
            from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
        except ImportError:
            from vllm.v1.core.kv_cache_planning import generate_scheduler_kv_cache_config
        self.sched = Scheduler(vllm_config=vconf, kv_cache_config=generate_scheduler_kv_cache_config([kvc]),
                               structured_output_manager=StructuredOutputManager(vconf),
                               block_size=sched_bs, hash_block_size=self.hash_bs, log_stats=True)
        with set_current_vllm_config(vconf):
            self.wconn = KVConnectorFactory.create_connector(vconf, KVConnectorRole.WORKER, kvc)
        size = max(t.offset + t.size for t in kvc.kv_cache_tensors)
        backing = torch.zeros(size, dtype=torch.int8, device=sc.get("device", "cpu"))
        self.kv, self.layer_of, self.block_of = {}, {}, {}
        index = {n: i for i, n in enumerate(self.specs)}
        for t in kvc.kv_cache_tensors:
            for li, name in enumerate(t.layers):
                off = t.offset + li * t.layer_stride
                self.layer_of[name] = index[name]
                if self.shape[index[name]][0] == "page":  # opaque bytes, this layer's own stride
                    self.kv[name] = backing.view(torch.uint8).as_strided(
                        (kvc.num_blocks, self.shape[index[name]][1]), (t.block_stride, 1), off)
                    self.block_of[name] = int(self.specs[name].block_size)
                    continue
                if self.shape[index[name]][0] == "state":
                    n = self.shape[index[name]][1]
                    self.kv[name] = backing.view(torch.float32).as_strided(
                        (kvc.num_blocks, n), (t.block_stride // 4, 1), off // 4)
                    self.block_of[name] = int(self.specs[name].block_size)
                    continue
                k, lbs, e = self.shape[index[name]]
                self.kv[name] = backing.view(torch.float32).as_strided(
                    (kvc.num_blocks, k, lbs, e), (t.block_stride // 4, lbs * e, e, 1), off // 4)
                self.block_of[name] = lbs
        with set_current_vllm_config(vconf):
            self.wconn.register_kv_caches(self.kv)
        meta = self.wconn.get_handshake_metadata()  # as EngineCore does after registration
        if meta is not None:
            self.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.hash_bs, sha256)
        self.failed: set[str] = set()
        self.recving: set[str] = set()
        self.stats: list = []  # SchedulerStats of every step (the scheduler runs with log_stats)

    # -- the fake engine -------------------------------------------------------------------------
    def value(self, token: int, pos: int, layer: int) -> float:
        return float(token * 1000 + pos) + layer * 0.25

    def forward(self, so) -> None:
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            start = req.num_computed_tokens - n  # schedule() already advanced it
            blocks = self.sched.kv_cache_manager.get_block_ids(req_id)
            for g, group in enumerate(self.kvc.kv_cache_groups):
                for name in group.layer_names:
                    lbs = self.block_of[name]
                    if self.is_state(name):
                        self.write_states(req, name, blocks[g], start, start + n)
                        continue
                    if self.is_page(name):
                        self.write_pages(req.all_token_ids, name, blocks[g], start, start + n)
                        continue
                    for pos in range(start, start + n):
                        if pos // lbs >= len(blocks[g]):
                            continue
                        b = blocks[g][pos // lbs]
                        if b:
                            self.kv[name][b, :, pos % lbs] = self.value(req.all_token_ids[pos], pos,
                                                                       self.layer_of[name])

    def is_page(self, name: str) -> bool:
        return self.shape[self.layer_of[name]][0] == "page"

    def page_value(self, tokens: list[int], b: int, name: str) -> object:
        """An opaque page's bytes: int32s seed + 0, 1, 2, ..., seed a function of the block's
        tokens so far, its index and the layer."""
        seed = hash((tuple(tokens), b, self.layer_of[name])) & 0x3FFFFFFF
        n = self.kv[name].shape[1] // 4
        return (self.torch.arange(n, dtype=self.torch.int32) + seed).view(self.torch.uint8)

    def write_pages(self, tokens: list[int], name: str, blocks: list[int], start: int, end: int) -> None:
        """DeepSeek-V4 caches (compressed entries, compressor states): a block's page is a
        function of the tokens of the block computed so far."""
        lbs = self.block_of[name]
        for b in range(start // lbs, -(-end // lbs)):
            if b < len(blocks) and blocks[b]:
                self.kv[name][blocks[b]] = self.page_value(tokens[b * lbs:min(end, (b + 1) * lbs)], b, name)

    def is_state(self, name: str) -> bool:
        return self.shape[self.layer_of[name]][0] == "state"

    def write_states(self, req, name: str, blocks: list[int], start: int, end: int) -> None:
        """A state layer's block b holds the state after the block's last token (vLLM's align
        mode); the fake state is f(that token, its position, layer) in every element. Written for
        each block boundary this step crossed, and for the block holding the step's last token
        (the running state). Outside align mode vLLM keeps one running state per request, which
        every step overwrites: a stored block then holds the state of wherever the request was."""
        lbs = self.block_of[name]
        if self.mamba_mode != "align":  # one running state, overwritten every step
            for bid in blocks:
                if bid:
                    self.kv[name][bid] = self.value(req.all_token_ids[end - 1], end - 1, self.layer_of[name])
            return
        for b in range(start // lbs, -(-end // lbs)):
            last = min(end, (b + 1) * lbs) - 1
            if last < start or b >= len(blocks) or not blocks[b]:
                continue
            self.kv[name][blocks[b]] = self.value(req.all_token_ids[last], last, self.layer_of[name])

    def step(self):
        from vllm.forward_context import ForwardContext
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        self.wconn.handle_preemptions(meta)
        self.wconn.bind_connector_metadata(meta)
        self.wconn.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
        self.forward(so)
        if so.total_num_scheduled_tokens > 0:
            self.wconn.wait_for_save()
        res = self.wconn.get_transfer_results(so.finished_req_ids)
        self.failed |= set(res.failed_recving or ())
        self.recving |= set(res.finished_recving or ())
        wstats = self.wconn.get_kv_connector_stats()  # as vLLM's model runner asks, every step
        wmeta = self.wconn.build_connector_worker_meta()
        self.wconn.clear_connector_metadata()
        reqs = [r.request_id for r in self.sched.running]
        out = ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                                sampled_token_ids=[[7] for _ in reqs],
                                kv_connector_output=KVConnectorOutput(
                                    finished_sending=res.finished_sending or None,
                                    finished_recving=res.finished_recving or None,
                                    failed_recving=set(res.failed_recving or ()),
                                    kv_connector_stats=wstats,
                                    kv_connector_worker_meta=wmeta))
        for eco in self.sched.update_from_output(so, out).values():
            if eco.scheduler_stats is not None:  # what EngineCore sends the front end
                self.stats.append(eco.scheduler_stats)
        return so

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req = Request(request_id=req_id, prompt_token_ids=prompt,
                      sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      pooling_params=None, block_hasher=self.hasher)
        self.sched.add_request(req)
        return req

    def drain(self, steps: int = 5) -> None:
        for _ in range(steps):
            self.step()

    # -- checks ----------------------------------------------------------------------------------
    def check_loaded(self, req, prompt: list[int], upto: int) -> dict:
        """Compare every non-null block position < upto of every group with A's values."""
        blocks = self.sched.kv_cache_manager.get_block_ids(req.request_id)
        per_group = []
        for g, group in enumerate(self.kvc.kv_cache_groups):
            checked = bad = 0
            for name in group.layer_names:
                lbs = self.block_of[name]
                if self.is_page(name):  # whole blocks before `upto`: their page bytes
                    for b in range(upto // lbs):
                        bid = blocks[g][b] if b < len(blocks[g]) else 0
                        if bid == 0:
                            continue
                        checked += 1
                        want = self.page_value(prompt[b * lbs:(b + 1) * lbs], b, name)
                        bad += int(not bool(self.torch.equal(self.kv[name][bid], want)))
                    continue
                if self.is_state(name):  # a state block ending at or before `upto`: its state
                    for b in range(upto // lbs):
                        bid = blocks[g][b] if b < len(blocks[g]) else 0
                        if bid == 0:
                            continue
                        last = (b + 1) * lbs - 1
                        checked += 1
                        bad += int(not bool(self.torch.all(
                            self.kv[name][bid] == self.value(prompt[last], last, self.layer_of[name]))))
                    continue
                for pos in range(upto):
                    bid = blocks[g][pos // lbs]
                    if bid == 0:
                        continue
                    got = self.kv[name][bid, :, pos % lbs]
                    checked += 1
                    bad += int(not bool(self.torch.all(got == self.value(prompt[pos], pos, self.layer_of[name]))))
            per_group.append({"checked": checked, "mismatches": bad})
        return {"groups": per_group, "checked": sum(p["checked"] for p in per_group),
                "mismatches": sum(p["mismatches"] for p in per_group)}

    def counters(self) -> dict:
        """kvtier's counter files, written first: kvtier rewrites them at most once a second, and
        both sides live in this process (an engine's are read after it has shut down)."""
        from kvtier.integrations.vllm.counters import read_metrics

        manager = getattr(self.sched.connector.connector_scheduler, "manager", None)
        worker = getattr(self.wconn.connector_worker, "worker", None)
        for side in (manager, worker):
            if getattr(side, "metrics", None) is not None:
                side.metrics.flush(force=True)
        return read_metrics(self.tmp)


def _printed_transfer_config(model: str) -> dict:
    """The --kv-transfer-config `kvtier plan MODEL --engine vllm` prints (run in this process:
    the same vLLM version as the harness)."""
    import contextlib
    import io

    from kvtier.cli import main as kvtier_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = kvtier_main(["plan", model, "--engine", "vllm"])
    assert rc == 0, out.getvalue()
    line = next(x for x in out.getvalue().splitlines() if x.strip().startswith('{"kv_connector"'))
    return json.loads(line)


def run_two_requests(sc: dict) -> dict:
    h = Harness(sc)
    prompt = _store_a(h, int(sc.get("prompt_tokens", 200)))
    assert _fresh_gpu_cache(h), "vLLM refused reset_prefix_cache"
    if sc.get("fail_reads") == "load":
        for tier in h.wconn.connector_worker.worker.tiers.values():
            tier.read = lambda *a, **k: False  # every read misses, as a corrupt payload would
            tier.holds = lambda *a, **k: False  # (the cpu tier is read in place after this check)
    prompt_b = prompt + [50 + i for i in range(int(sc.get("b_extra_tokens", 8)))]
    req = h.add("b", prompt_b, max_tokens=3)
    external = 0
    result: dict = {}
    for _ in _steps():  # a load from disk or Redis finishes on kvtier's I/O thread
        before = req.num_computed_tokens
        so = h.step()
        n_sched = so.num_scheduled_tokens.get("b", 0)
        if n_sched:
            external = req.num_computed_tokens - n_sched
            # checked right after the step that computed B's tail: loaded positions are intact
            result = h.check_loaded(req, prompt_b, external)
            break
        assert req.num_computed_tokens >= before
        time.sleep(0.01)  # as a model step would take
    h.drain()
    disk = os.path.join(h.tmp, "disk")
    if os.path.isdir(disk):
        from kvtier.store.tiers.disk_scan import scan_dir

        recs = [r for r in scan_dir(disk) if r.problem is None]
        result["disk_slots"] = len(recs)
        result["disk_macs"] = sum(1 for r in recs if getattr(r.header, "mac", b""))
    result.update({"external_tokens": external, "failed": sorted(h.failed),
                   "recving": sorted(h.recving), "counters": h.counters(),
                   "num_groups": len(h.kvc.kv_cache_groups),
                   "geometry": [[gp.name, gp.kind, gp.group.tokens_per_block, gp.chunk_bytes]
                                for gp in h.wconn.connector_worker.spec.ctx.plan.groups],
                   "geometry_source": h.wconn.connector_worker.spec.ctx.plan.geometry.source,
                   "namespace": h.wconn.connector_worker.spec.ctx.namespace.id,
                   "scheduler_namespace": h.sched.connector.connector_scheduler.manager.ctx.namespace.id,
                   "blocks_per_chunk": h.wconn.connector_worker.spec.blocks_per_chunk
                   if hasattr(h.wconn.connector_worker, "spec") else None,
                   "printed": getattr(h, "printed", None)})
    return result


def run_partial(sc: dict) -> dict:
    """A chunk stored from its 4th block only must never serve a load that needs its 3rd."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from kvtier.integrations.vllm.common import ChunkItem, KvtierLoadStoreSpec

    h = Harness(sc)
    worker = h.wconn.connector_worker.worker
    bpc = worker.bpc
    ngroups = len(h.kvc.kv_cache_groups)
    g = 0
    item = ChunkItem(g, b"\x11" * 16, 0, bpc * h.bs, (("cpu", 0),))
    name = h.kvc.kv_cache_groups[g].layer_names[0]
    for b in (5, 6):  # blocks 5 and 6 hold distinct values
        h.kv[name][b] = float(b)

    def spec(blocks: list[int], first: int) -> GPULoadStoreSpec:
        sizes = [len(blocks) if i == g else 0 for i in range(ngroups)]
        return GPULoadStoreSpec(blocks, sizes, [first if i == g else 0 for i in range(ngroups)])

    out: dict = {"bpc": bpc}
    worker.submit_store(1, spec([6], bpc - 1), KvtierLoadStoreSpec([item]))  # last position only
    worker.wait({1})  # its copy ran (on a GPU, asynchronous: fake_cuda scenarios)
    # the slot's layout, whichever path copied: each layer ref's pages at its offset in the chunk,
    # block 6 at the chunk's last position (vLLM's handler and kvtier's index_copy agree)
    row = worker.tiers["cpu"].slabs[g][0]
    out["slot_layout"] = [bool(h.torch.equal(row[r.offset + (bpc - 1) * r.page_bytes:r.offset + bpc * r.page_bytes],
                                             h.torch.Tensor(r.tensor)[6, :r.page_bytes]))
                          for r in worker.refs[g]]
    h.kv[name][5] = -1.0
    h.kv[name][6] = -1.0
    worker.submit_load(2, KvtierLoadStoreSpec([item]), spec([6], bpc - 1), expedited=True)
    worker.wait({2})  # as vLLM waits for an expedited load
    out["narrow_load"] = [r.success for r in worker.get_finished() if r.job_id == 2]
    out["block6_restored"] = bool(h.torch.all(h.kv[name][6] == 6.0))
    h.kv[name][6] = -1.0
    worker.submit_load(3, KvtierLoadStoreSpec([item]), spec([5, 6], bpc - 2), expedited=False)
    out["wide_load"] = [r.success for r in worker.get_finished() if r.job_id == 3]
    out["block5_untouched"] = bool(h.torch.all(h.kv[name][5] == -1.0))
    out["block6_untouched"] = bool(h.torch.all(h.kv[name][6] == -1.0))
    # two chunks from block 0 but only bpc + 1 blocks: the second chunk would be short, which
    # only a gap (a null block left out) explains; the job must fail, not guess positions
    second = ChunkItem(g, b"\x22" * 16, bpc * h.bs, 2 * bpc * h.bs, (("cpu", 1),))
    worker.submit_store(5, spec(list(range(1, bpc + 2)), 0), KvtierLoadStoreSpec([item, second]))
    out["gap_store"] = [r.success for r in worker.get_finished() if r.job_id == 5]
    # an expedited (vLLM 0.33 sync) load whose tier read fails: the job fails, the block keeps
    # what it had
    h.kv[name][6] = -1.0
    for tier in worker.tiers.values():
        tier.read = tier.holds = lambda *a, **k: False
    from kvtier.integrations.vllm.worker import SyncLoadError

    try:  # the request would run on these blocks this step: the engine stops instead
        worker.submit_load(6, KvtierLoadStoreSpec([item]), spec([6], bpc - 1), expedited=True)
        out["failed_expedited_load"] = "no error"
    except SyncLoadError as exc:
        out["failed_expedited_load"] = str(exc)
    # one whose chunk is on disk: refused before any read (a sync load reads host memory only)
    slow = ChunkItem(g, b"\x11" * 16, 0, bpc * h.bs, (("disk", 0),))
    try:
        worker.submit_load(7, KvtierLoadStoreSpec([slow]), spec([6], bpc - 1), expedited=True)
        out["slow_expedited_load"] = "no error"
    except SyncLoadError as exc:
        out["slow_expedited_load"] = str(exc)
    out["block6_kept"] = bool(h.torch.all(h.kv[name][6] == -1.0))
    return out


def _store_a(h: Harness, n: int) -> list[int]:
    return _run_to_end(h, "a", [100 + (i * 7919) % 900 for i in range(n)])


def _store_c(h: Harness, n: int) -> list[int]:
    """Another prompt of n tokens, sharing nothing with A's, run to its end: its stores evict
    A's chunks from a cpu tier sized for one prompt."""
    return _run_to_end(h, "c", [3000 + (i * 7919) % 900 for i in range(n)])


def _run_to_end(h: Harness, req_id: str, prompt: list[int]) -> list[int]:
    h.add(req_id, prompt)
    for _ in _steps():
        so = h.step()
        if not h.sched.requests:
            break
        if not so.total_num_scheduled_tokens:  # it waits on a Redis lookup (answered RETRY):
            time.sleep(0.01)  # the answer comes from a background thread, as a model step would
    h.drain()
    return prompt


def _fresh_gpu_cache(h: Harness) -> bool:
    ok = h.sched.reset_prefix_cache()
    for t in h.kv.values():
        t.zero_()
    return bool(ok)


def _hold_results(h: Harness) -> None:
    """Make the worker's finished transfers reach vLLM only after `h.hold` more polls, as a GPU's
    asynchronous copies would: a load stays in flight across steps."""
    w = h.wconn.connector_worker.worker
    orig, held = w.get_finished, []
    h.hold = 0

    def get_finished():
        held.extend(orig())
        if h.hold > 0:
            h.hold -= 1
            return []
        out = held[:]
        held.clear()
        return out

    w.get_finished = get_finished


def _load_and_check(h: Harness, req_id: str, prompt: list[int]) -> dict:
    req = h.add(req_id, prompt, max_tokens=2)
    for _ in _steps():
        so = h.step()
        n = so.num_scheduled_tokens.get(req_id, 0)
        if n:
            ext = req.num_computed_tokens - n
            out = h.check_loaded(req, prompt, ext)
            out["external_tokens"] = ext
            h.drain()
            return out
        time.sleep(0.01)
    return {"external_tokens": -1, "checked": 0, "mismatches": 0, "never_scheduled": True}


def _pins(h: Harness) -> int:
    """Entries the manager's index holds pinned (a load in flight), plus its own pin records."""
    manager = h.sched.connector.scheduler.manager
    stats = manager.index.stats()
    index_pins = sum(g["pinned"] for tier in stats["tiers"].values() for g in tier["groups"].values())
    return index_pins + manager.loads.pins()


def run_lifecycle(sc: dict) -> dict:
    """Abort, reset and repeated stores around transfers in flight; afterwards nothing is left
    pinned and every byte any later request loads is right."""
    from vllm.v1.request import RequestStatus

    h = Harness(sc)
    _hold_results(h)
    kind = sc["lifecycle"]
    n = int(sc.get("prompt_tokens", 200))
    out: dict = {}
    if kind == "repeat_store":  # two requests store the same chunks at once
        prompt = [100 + (i * 7919) % 900 for i in range(n)]
        h.add("a1", prompt)
        h.add("a2", prompt)
        h.hold = 2
        for _ in range(40):
            h.step()
            if not h.sched.requests:
                break
        h.drain()
    elif kind == "preempt_store":  # A and A2 outgrow the GPU cache while stores are in flight
        prompt = [100 + (i * 7919) % 900 for i in range(n)]
        h.add("a", prompt, max_tokens=int(sc.get("decode_tokens", 64)))
        h.add("a2", [900 - (i * 31) % 800 for i in range(n)], max_tokens=int(sc.get("decode_tokens", 64)))
        h.hold = 2
        preempted = 0
        for i in range(400):
            so = h.step()
            preempted += len(getattr(so, "preempted_req_ids", None) or ())
            if i % 3 == 0:  # results reach vLLM a step late: stores stay in flight
                h.hold = max(h.hold, 1)
            if not h.sched.requests:
                break
        h.hold = 0
        h.drain()
        out["preempted"] = preempted
        out["unfinished"] = sorted(h.sched.requests)
        out["num_blocks"] = h.kvc.num_blocks
    else:
        prompt = _store_a(h, n)
    if kind == "reset_store":  # A's last stores are still queued when the cache is reset
        h.add("a2", prompt + [7, 7, 7])
        h.hold = 3
        h.step()
        out["reset_ok"] = _fresh_gpu_cache(h)
        h.drain(8)
    out["reset_ok"] = _fresh_gpu_cache(h)
    if kind == "abort_load":  # B's load is in flight when B is aborted
        h.add("b", prompt + [1, 2, 3])
        h.hold = 3
        h.step()
        out["b_waiting"] = "b" in h.sched.requests
        h.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        h.drain(8)
    elif kind == "reset_load":  # the cache is reset while B's load is in flight
        h.add("b", prompt + [1, 2, 3])
        h.hold = 3
        h.step()
        out["reset_during_load"] = bool(h.sched.reset_prefix_cache())
        h.drain(10)
        _fresh_gpu_cache(h)
    out["pins_left"] = _pins(h)
    out["c"] = _load_and_check(h, "c", prompt + [4, 5, 6])
    out["pins_after_c"] = _pins(h)
    out["counters"] = h.counters()
    return out


def run_slow_disk(sc: dict) -> dict:
    """A disk that does not answer until released: the engine's steps go on (submit_store
    returns with the disk writes queued), writes past kvtier.io_queue_bytes are dropped and
    counted, and once the disk answers the queued writes land."""
    import threading

    h = Harness(sc)
    worker = h.wconn.connector_worker.worker
    disk = worker.tiers["disk"]
    gate, entered = threading.Event(), threading.Event()
    write_many = disk.write_many

    def held(batch):
        entered.set()
        if not gate.wait(20):  # released by the test below; 20 s means the engine blocked
            raise TimeoutError("disk never released")
        return write_many(batch)

    disk.write_many = held
    prompt = [100 + (i * 7919) % 900 for i in range(int(sc.get("prompt_tokens", 200)))]
    h.add("a", prompt)
    steps = 0
    while h.sched.requests and steps < 40:
        h.step()
        steps += 1
    finished = not h.sched.requests  # A ran to the end with every disk write held
    h.drain(2)  # on a GPU, A's last store job ends at a later step's poll
    started = entered.wait(10)  # the I/O thread reached the disk (it copies the cpu slot first)
    c = h.counters()
    out = {"steps": steps, "a_finished": finished, "disk_write_started": started,
           "held": {k: c.get(k, 0) for k in ("store_jobs", "stored_chunks_cpu", "stored_chunks_disk",
                                             "store_dropped_disk")}}
    gate.set()
    worker.drain()
    worker.metrics.flush(force=True)
    c = h.counters()
    out["released"] = {k: c.get(k, 0) for k in ("stored_chunks_disk", "store_dropped_disk")}
    out["c"] = _load_and_check(h, "c", prompt + [4, 5, 6]) if _fresh_gpu_cache(h) else {}
    return out


def run_slow_redis(sc: dict) -> dict:
    """A second scheduler index that does not know A's chunks (a new engine sharing Redis): B's
    lookups go to Redis, which does not answer until released. The steps go on (lookups answer
    RETRY, B waits), then B restores every byte from Redis."""
    import threading

    h = Harness(sc)
    prompt = _store_a(h, int(sc.get("prompt_tokens", 200)))
    worker = h.wconn.connector_worker.worker
    worker.drain()  # A's Redis writes landed
    manager = h.sched.connector.connector_scheduler.manager
    manager.reset_cache()  # forget A's chunks, as a second engine's index would not know them
    assert _fresh_gpu_cache(h)
    gate, asked = threading.Event(), threading.Event()
    exists_many = manager.redis_lookup.redis.exists_many

    def held(headers):
        asked.set()
        gate.wait(60)
        return exists_many(headers)

    manager.redis_lookup.redis.exists_many = held
    req = h.add("b", prompt + [1, 2, 3], max_tokens=2)
    steps = 0
    while steps < 20 and not req.num_computed_tokens:
        h.step()
        steps += 1
        time.sleep(0.01)  # as a model step would take: the lookup thread gets to ask meanwhile
    # the lookup thread asked (waited for: on a loaded machine it may not have run in 0.2 s; while
    # it is held, steps keep running and B stays unscheduled either way)
    out = {"steps_while_held": steps, "asked": asked.wait(10), "b_waiting": "b" in h.sched.requests
           and not req.num_computed_tokens}
    gate.set()
    for _ in _steps():
        so = h.step()
        n = so.num_scheduled_tokens.get("b", 0)
        if n:
            ext = req.num_computed_tokens - n
            out["b"] = h.check_loaded(req, prompt + [1, 2, 3], ext)
            out["b"]["external_tokens"] = ext
            break
        time.sleep(0.01)
    h.drain()
    out["counters"] = h.counters()
    return out


def run_stats(sc: dict) -> dict:
    """kvtier's counters through vLLM's own stats path, as `vllm serve` runs it: the worker's and
    the scheduler's connector stats of every step, the scheduler's payload encoded and decoded as
    EngineCore sends it to the front end, then vLLM's PrometheusStatLogger and its periodic
    connector log line. Returns the Prometheus text, every kvtier sample, and the counter files."""
    import logging

    from prometheus_client import REGISTRY, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    h = Harness(sc)
    prompt = _store_a(h, int(sc.get("prompt_tokens", 200)))
    worker = h.wconn.connector_worker.worker
    worker.drain()  # A's disk writes landed (counted on the I/O thread)
    assert _fresh_gpu_cache(h)
    _store_c(h, len(prompt))  # another prompt's chunks evict A's first ones from the small cpu tier
    worker.drain()  # C's disk writes landed
    assert _fresh_gpu_cache(h)
    c = _load_and_check(h, "b", prompt + [1, 2, 3])
    h.drain()  # the steps after them report what was counted since the last one
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    prom = PrometheusStatLogger(h.vconf, [0])
    logging_ = KVConnectorLogging(h.vconf.kv_transfer_config)
    payload_types = set()
    for st in h.stats:
        st = dec.decode(enc.encode(EngineCoreOutputs(scheduler_stats=st))).scheduler_stats
        if st.kv_connector_stats is not None:
            payload_types.add(type(logging_.connector_cls.build_kv_connector_stats(st.kv_connector_stats)).__name__)
            logging_.observe(st.kv_connector_stats)
        prom.record(scheduler_stats=st, iteration_stats=None, engine_idx=0)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    text = generate_latest(REGISTRY).decode()
    samples = {}
    for metric in REGISTRY.collect():
        for smp in metric.samples:
            if smp.name.startswith(("vllm:kvtier_", "vllm:kv_offload", "vllm:prompt_tokens_cached_by_source")):
                labels = {k: v for k, v in smp.labels.items() if k not in ("model_name", "engine")}
                samples.setdefault(smp.name, []).append([labels, smp.value])
    from kvtier.integrations.vllm.stats import SERIES

    return {"c": c, "counters": h.counters(), "samples": samples, "log": lines,
            "series": {k: [m, t, list(labels)] for k, (m, t, labels) in SERIES.items()},
            "payload_types": sorted(payload_types), "steps_with_stats": len(h.stats),
            "kvtier_lines": [x for x in text.splitlines() if x.startswith("vllm:kvtier_")]}


def run_promote(sc: dict) -> dict:
    """A chunk loaded from disk is promoted into the cpu tier: A's chunks are stored in both
    tiers, C's evict them from the cpu tier (a pool sized for one prompt), B loads A's chunks from
    disk, and B2 (the same prefix, the GPU cache emptied again) loads them from host memory. With
    fail_reads, B's disk reads fail: nothing is promoted and no later request is offered them;
    with abort too, B is aborted while that failing load is in flight."""
    from vllm.v1.request import RequestStatus

    h = Harness(sc)
    worker = h.wconn.connector_worker.worker
    if sc.get("abort"):
        _hold_results(h)
    promoter = h.sched.connector.connector_scheduler.manager.promotions.promoter
    if sc.get("instant_reads"):  # every promotion read done before its lookup returns (a fast disk)
        fetch = promoter.fetch

        def fetch_now(*a, **k):  # noqa: ANN202
            queued = fetch(*a, **k)
            promoter.drain()
            return queued

        promoter.fetch = fetch_now
    # mapped at the handshake, before any request; its file then removed (both processes hold it)
    start = {"mapped_at_start": promoter.ready(),
             "region_file_left": promoter.ready() and os.path.exists(promoter.ranks[0].cpu.region.path)}
    prompt = _store_a(h, int(sc.get("prompt_tokens", 200)))
    worker.drain()
    _store_c(h, len(prompt))
    worker.drain()
    out: dict = {"after_c": h.counters(), **start}
    reads = {}
    if sc.get("fail_reads"):  # the worker's reads (at load) and the scheduler's (at lookup)
        for tier in _slow_readers(h):
            reads[tier] = tier.read
            tier.read = lambda *a, **k: False  # as a corrupt payload reads
    assert _fresh_gpu_cache(h)
    if sc.get("reset_during_fetch"):  # B's lookup promotions are held; the cache is reset
        import threading

        from vllm.v1.request import RequestStatus as _RS

        promoter = h.sched.connector.connector_scheduler.manager.promotions.promoter
        assert promoter.ready(), "the scheduler did not map the worker's host region"
        disk, gate = promoter.ranks[0].tiers["disk"], threading.Event()
        read = disk.read
        disk.read = lambda *a, **k: gate.wait(10) and read(*a, **k)
        h.add("b", prompt + [1, 2, 3])
        h.step()
        out["b_pending"] = "b" in h.sched.requests and h.counters().get("promote_at_lookup", 0) > 0
        h.sched.finish_requests("b", _RS.FINISHED_ABORTED)
        h.step()
        out["reset_ok"] = bool(h.sched.reset_prefix_cache(reset_connector=True))
        out["resets"] = h.counters().get("resets", 0)
        manager = h.sched.connector.connector_scheduler.manager
        out["held_after_reset"] = manager.promotions.reset_unflushed  # no promotion at lookup until flushed
        out["flushed_at_reset"] = h.counters().get("resets_flushed", 0)  # 0.33 with nothing in flight
        # D's stores take the new index's cpu slots, the ones B's held reads were reserved in
        d = _run_to_end(h, "d", [6000 + (i * 7919) % 900 for i in range(len(prompt))])
        disk.read = read
        gate.set()
        promoter.drain()
        h.step()  # the held reads land: dropped, nothing written into D's slots
        out["after_b"] = h.counters()
        out["held_at_end"] = manager.promotions.reset_unflushed
        return _reload_and_settle(h, out, "d2", d + [7, 8, 9])
    if sc.get("steal_source"):  # B's lookup promotions are held while D's stores fill the disk tier
        import threading

        promoter = h.sched.connector.connector_scheduler.manager.promotions.promoter
        assert promoter.ready(), "the scheduler did not map the worker's host region"
        disk, gate = promoter.ranks[0].tiers["disk"], threading.Event()
        read = disk.read
        disk.read = lambda *a, **k: gate.wait(10) and read(*a, **k)
        b = prompt + [1, 2, 3]
        h.add("b", b, max_tokens=2)
        h.step()
        out["b_pending"] = h.counters().get("promote_at_lookup", 0)
        # D (nothing in common with A or C, twice as long) stores into a disk tier that holds two
        # prompts: it evicts every entry of A's and C's it may, not a source a held read is reading
        h.add("d", [6000 + (i * 7919) % 900 for i in range(2 * len(prompt))])
        for _ in _steps():
            h.step()
            if "d" not in h.sched.requests:
                break
        worker.drain()  # D's disk writes landed
        out["after_d"] = h.counters()
        disk.read = read
        gate.set()
        promoter.drain()
        req = h.sched.requests.get("b")
        out["b_waited"] = req is not None  # B did not run while its promotion was held
        for _ in range(500 if req is not None else 0):  # B resumes: its promotions land, it loads what is left of its hit
            so = h.step()
            n = so.num_scheduled_tokens.get("b", 0)
            if n:
                ext = req.num_computed_tokens - n
                out["b"] = {**h.check_loaded(req, b, ext), "external_tokens": ext}
                break
            time.sleep(0.01)
        worker.drain()
        promoter.drain()
        h.drain()
        out["after_b"] = h.counters()
        out["failed"] = sorted(h.failed)
        out["pins"] = _pins(h)
        return out
    if sc.get("abort"):  # B's load is in flight when B is aborted; then the load fails
        h.add("b", prompt + [1, 2, 3])
        h.hold = 3
        h.step()
        out["b_waiting"] = "b" in h.sched.requests
        h.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        h.drain(8)
        out["b"] = {"external_tokens": 0, "checked": 0, "mismatches": 0}
    else:
        out["b"] = _load_and_check(h, "b", prompt + [1, 2, 3])
    worker.drain()  # B's reads ran (with the failing read in place) before it is restored
    h.sched.connector.connector_scheduler.manager.promotions.promoter.drain()
    for tier, read in reads.items():
        tier.read = read
    h.drain()
    out["after_b"] = h.counters()
    _reload_and_settle(h, out, "b2", prompt + [4, 5, 6])
    out["groups"] = len(h.kvc.kv_cache_groups)
    return out


def _slow_readers(h: Harness) -> list:
    """The disk and Redis tier objects that read chunks: the worker's (loads) and, where the
    scheduler mapped the worker's host region, its promoter's (promotion at lookup)."""
    out = [t for name, t in h.wconn.connector_worker.worker.tiers.items() if name != "cpu"]
    promoter = h.sched.connector.connector_scheduler.manager.promotions.promoter
    if promoter.ready():
        out += [t for r in promoter.ranks for t in r.tiers.values()]
    return out


def _reload_and_settle(h: Harness, out: dict, req_id: str, prompt: list[int]) -> dict:
    """vLLM's own cache emptied, `req_id` loads and is checked; then what is left afterwards:
    counters, failed requests, pins, promotions in flight (at load or at lookup)."""
    assert _fresh_gpu_cache(h)
    out[req_id] = _load_and_check(h, req_id, prompt)
    h.wconn.connector_worker.worker.drain()
    h.sched.connector.connector_scheduler.manager.promotions.promoter.drain()
    h.drain()
    out[f"after_{req_id}"] = h.counters()
    out["failed"] = sorted(h.failed)
    out["pins"] = _pins(h)
    manager = h.sched.connector.connector_scheduler.manager
    out["promoting"] = len(manager.promotions.promoting) + len(manager.promotions.fetches)
    return out


def run_submit_timing(sc: dict) -> dict:
    """Median wall time of submit_store / submit_load over N one-chunk jobs, with the worker's
    disk and Redis I/O on its background thread (as shipped) and inline (the lane switched off),
    side by side in one run. A measurement for the closing note and docs, not a test."""
    import statistics

    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from kvtier.integrations.vllm.common import ChunkItem, KvtierLoadStoreSpec

    h = Harness(sc)
    worker = h.wconn.connector_worker.worker
    n = int(sc.get("jobs", 1000))
    g, bpc = 3, worker.bpc  # the full-attention group
    ngroups = len(h.kvc.kv_cache_groups)
    tiers = [t for t in worker.tiers]
    slots = min(worker.ctx.new_index().slots(g, t) for t in tiers if t != "redis")

    def spec(block: int) -> GPULoadStoreSpec:
        return GPULoadStoreSpec([block] * bpc, [bpc if i == g else 0 for i in range(ngroups)],
                                [0] * ngroups)

    def run(mode: str) -> dict:
        lane = worker.slow.lane
        if mode == "inline":
            worker.slow.lane = None
        store_t, load_t = [], []
        for j in range(n):
            item = ChunkItem(g, j.to_bytes(4, "big") * 4, 0, bpc * h.bs, tuple((t, j % slots) for t in tiers))
            t0 = time.perf_counter()
            worker.submit_store(j, spec(1 + j % 8), KvtierLoadStoreSpec([item]))
            store_t.append(time.perf_counter() - t0)
            worker.get_finished()
        worker.drain()
        for j in range(n):  # read back from the slowest configured tier
            slow = [t for t in tiers if t != "cpu"][-1]
            item = ChunkItem(g, j.to_bytes(4, "big") * 4, 0, bpc * h.bs, ((slow, j % slots),))
            t0 = time.perf_counter()
            worker.submit_load(10 ** 6 + j, KvtierLoadStoreSpec([item]), spec(9 + j % 8))
            load_t.append(time.perf_counter() - t0)
            worker.get_finished()
        worker.drain()
        worker.get_finished()
        worker.slow.lane = lane
        return {"store_median_ms": statistics.median(store_t) * 1e3,
                "load_median_ms": statistics.median(load_t) * 1e3}

    def promote() -> dict:
        """Load jobs' time to finish (submit_load until get_finished reports them): each chunk
        read from disk and promoted into a cpu slot, then the same chunk again from that slot."""
        if "cpu" not in tiers or "disk" not in tiers:
            return {}
        first, again = [], []
        for j in range(n):
            h_ = (10 ** 6 + j).to_bytes(4, "big") * 4
            item = ChunkItem(g, h_, 0, bpc * h.bs, (("disk", j % slots),))
            worker.submit_store(2 * 10 ** 6 + j, spec(1 + j % 8), KvtierLoadStoreSpec([item]))
            worker.drain()
            worker.get_finished()
            for times, places in ((first, (("disk", j % slots), ("cpu", j % slots))),
                                  (again, (("cpu", j % slots),))):
                job = 3 * 10 ** 6 + 2 * j + (times is again)
                t0 = time.perf_counter()
                worker.submit_load(job, KvtierLoadStoreSpec([ChunkItem(g, h_, 0, bpc * h.bs, places)]),
                                   spec(9 + j % 8))
                while not any(r.job_id == job and r.success for r in worker.get_finished()):
                    time.sleep(0)
                times.append(time.perf_counter() - t0)
        return {"disk_then_promoted_ms": statistics.median(first) * 1e3,
                "again_from_cpu_ms": statistics.median(again) * 1e3,
                "disk_over_cpu": statistics.median(first) / statistics.median(again)}

    out = {"jobs": n, "tiers": tiers, "background": run("background"), "inline": run("inline"),
           "promote": promote()}
    out["store_ratio_inline_over_background"] = out["inline"]["store_median_ms"] / out["background"]["store_median_ms"]
    out["load_ratio_inline_over_background"] = out["inline"]["load_median_ms"] / out["background"]["load_median_ms"]
    return out


def conversation_sessions(path: str, sessions: int, max_blocks: int = 40, min_turns: int = 3,
                          scan: int = 3000) -> list[dict]:
    """A multi-turn workload derived from Mooncake's conversation trace: its first `sessions`
    conversations (a request that repeats all but the last block of an earlier one is its next
    turn) of at least `min_turns` turns and at most `max_blocks` blocks a prompt, their requests in
    trace order. Each returned request is {"hash_ids", "input_length"}."""
    reqs: list[dict] = []
    with open(path) as f:
        for line in f:
            reqs.append(json.loads(line))
            if len(reqs) >= scan:
                break
    session_of: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for k, r in enumerate(reqs):
        ids, parent = r["hash_ids"], None
        for q in range(k - 1, -1, -1):  # the latest earlier request this one continues
            prev = reqs[q]["hash_ids"]
            common = next((m for m, (a, b) in enumerate(zip(prev, ids)) if a != b), min(len(prev), len(ids)))
            if common >= max(2, len(prev) - 1):  # block 0 alone is the shared system prompt
                parent = q
                break
        s = session_of[parent] if parent is not None else k
        session_of[k] = s
        members.setdefault(s, []).append(k)
    chosen = [s for s, ks in members.items()
              if len(ks) >= min_turns and all(len(reqs[k]["hash_ids"]) <= max_blocks for k in ks)][:sessions]
    return [reqs[k] for k in sorted(k for s in chosen for k in members[s])]


def trace_prompt(req: dict, block_tokens: int) -> list[int]:
    """A trace request's prompt: each 512-token trace block becomes `block_tokens` token ids (a
    function of the block's id), the last block its share of 512 tokens (1 .. block_tokens - 1)."""
    ids, c = req["hash_ids"], block_tokens

    def block(b: int, n: int) -> list[int]:
        return [((b * c + j) * 2654435761) % 1000 + 10 for j in range(n)]

    tail = req["input_length"] - 512 * (len(ids) - 1)
    out = [t for b in ids[:-1] for t in block(b, c)]
    return out + block(ids[-1], min(c - 1, max(1, tail * c // 512)))


def run_multi_turn(sc: dict) -> dict:
    """Sessions of the conversation trace through one engine per placement, same cpu bytes: per
    request, vLLM's prefix cache is reset first (every reused token comes from kvtier) and every
    loaded position of every group is compared with what its earlier forward wrote."""
    workload = conversation_sessions(sc["trace"], int(sc.get("sessions", 12)))
    out: dict = {"requests": len(workload)}
    for placement in sc.get("placements", ("every", "hits")):
        h = Harness(dict(sc, extra={**sc.get("extra", {}), "kvtier.placement": placement}))
        restored = checked = bad = hits = 0
        for n, req in enumerate(workload):
            prompt = trace_prompt(req, h.bs)
            assert _fresh_gpu_cache(h), "vLLM refused reset_prefix_cache"
            r = _load_and_check(h, f"r{n}", prompt)
            assert r["external_tokens"] >= 0, r
            restored += r["external_tokens"]
            hits += int(r["external_tokens"] > 0)
            checked += r["checked"]
            bad += r["mismatches"]
            for _ in _steps(10.0):  # to its end: its stores are submitted when it finishes
                if not h.sched.requests:
                    break
                h.step()
            h.drain()
        c = h.counters()
        manager = h.sched.connector.scheduler.manager
        stats = manager.index.stats()["tiers"]["cpu"]["groups"]
        out[placement] = {"restored_tokens": restored, "hit_requests": hits, "checked": checked,
                          "mismatches": bad, "failed": sorted(h.failed),
                          "slots": {name: g["slots"] for name, g in stats.items()},
                          "slot_bytes": {name: g["slot_bytes"] for name, g in stats.items()},
                          "skipped": c.get("store_skipped_placement", 0), "cold": c.get("store_cold", 0),
                          "store_chunks": c.get("store_chunks", 0),
                          "stored_bytes_cpu": c.get("stored_bytes_cpu", 0)}
    return out


def run_lookups(sc: dict) -> dict:
    """Many distinct keys looked up (all misses): the manager's per-key maps stay bounded."""
    import random

    h = Harness(sc)
    manager = h.sched.connector.scheduler.manager
    rng = random.Random(0)
    n = int(sc.get("lookups", 20000))
    with getattr(manager, "lock", None) or _null():
        for _ in range(n):
            manager.lookup(rng.randbytes(32) + (0).to_bytes(4, "big"), None)
        info = manager.config_info() if hasattr(manager, "config_info") else None
    spec_cls = type(h.wconn.connector_worker.spec)
    keys = spec_cls.config_info_keys({}) if hasattr(spec_cls, "config_info_keys") else None
    return {"lookups": n, "okey": len(manager.held.key_of), "split": len(manager._split),
            "config_info": info, "config_info_keys": list(keys) if keys is not None else None}


def _null():
    import contextlib
    return contextlib.nullcontext()


def main() -> None:
    import vllm

    scenarios = json.loads(sys.argv[1])
    results = {"vllm_version": vllm.__version__, "vllm_file": vllm.__file__}
    for sc in scenarios:
        try:
            run = (run_partial if sc.get("partial") else run_lookups if sc.get("lookups")
                   else run_slow_disk if sc.get("slow_disk") else run_slow_redis if sc.get("slow_redis")
                   else run_submit_timing if sc.get("submit_timing")
                   else run_stats if sc.get("stats") else run_promote if sc.get("promote")
                   else run_lifecycle if sc.get("lifecycle") else run_multi_turn if sc.get("trace")
                   else run_two_requests)
            if sc.get("fake_cuda"):
                import fake_cuda
                with fake_cuda.installed():
                    results[sc["name"]] = run(sc)
                    results[sc["name"]]["handler_transfers"] = fake_cuda.transfers()
                    results[sc["name"]]["side_copies"] = fake_cuda.side_copies()
            else:
                results[sc["name"]] = run(sc)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
            results[sc["name"]] = {"error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
