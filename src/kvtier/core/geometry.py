"""Groups and geometries: what a model's KV cache looks like, layer kind by layer kind.

A *group* is a set of layers that share one KV spec (kind, tokens per block, bytes per token
or state bytes, dtype). A *geometry* is the list of groups of one model plus
`tokens_per_hash`, the hash unit. Group order is part of the geometry: the group index is
part of every key.

Invariants (checked in `Group.__post_init__` / `Geometry.__post_init__`):
- attention kinds (`full`, `mla`, `sliding`, `chunked`) have `bytes_per_token_per_layer > 0`
  and no `state_bytes_per_layer`; `state` has `state_bytes_per_layer > 0` and no per-token bytes;
- `sliding` has a `window >= 1`, `chunked` an `attention_chunk >= 1`, other kinds neither;
- `compress_ratio` (default 1) is how many tokens one cache entry covers: DeepSeek V4's
  compressed caches hold one entry per 4 or 128 tokens, so their bytes per token are not whole.
  For such a group `bytes_per_token_per_layer` is the bytes of one *entry*; only `full` and `mla`
  groups (a compressed cache keeps every entry of the history) may have a ratio above 1, and
  `tokens_per_block` is a multiple of it (a block holds whole entries). Sizes go through
  `Group.bytes_for_tokens`, never `bytes_per_token * tokens`;
- a group that is not cacheable says why (`reason`); it stays in the geometry so both sides
  of a connection see the same group indices (never silently dropped on one side only);
- group names are unique;
- a layer is in at most one attention group and one state group, except in a geometry with
  compressed groups (DeepSeek V4: a layer holds several caches).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from kvtier.errors import ConfigError

KINDS = ("full", "mla", "sliding", "chunked", "state")
ATTENTION_KINDS = ("full", "mla", "sliding", "chunked")

# bytes per element of the dtypes kvtier knows; a KV cache is stored in one of these.
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}

_GROUP_FIELDS = {
    "name",
    "kind",
    "num_layers",
    "tokens_per_block",
    "bytes_per_token_per_layer",
    "state_bytes_per_layer",
    "window",
    "attention_chunk",
    "dtype",
    "cacheable",
    "reason",
    "layers",
    "compress_ratio",
}
_GEOMETRY_FIELDS = {"name", "tokens_per_hash", "groups"}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype`, or a ConfigError listing the known dtypes."""
    if not isinstance(dtype, str):
        raise ConfigError(f"dtype {dtype!r} is not a name; use one of: {', '.join(DTYPE_BYTES)}")
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}; use one of: {', '.join(DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True, slots=True)
class Group:
    """One KV-cache group: layers that share kind, tokens per block, bytes and dtype."""

    name: str
    kind: str
    num_layers: int
    tokens_per_block: int
    bytes_per_token_per_layer: int = 0
    state_bytes_per_layer: int = 0
    window: int | None = None
    attention_chunk: int | None = None
    dtype: str = "bfloat16"
    cacheable: bool = True
    reason: str = ""
    # the model layer indices the group covers, in the order the group's blocks hold them;
    # empty when unknown (a hand-written geometry JSON). Integrations map groups back to model
    # layers with it, so when given it is part of the fingerprint.
    layers: tuple[int, ...] = ()
    # tokens per cache entry (DeepSeek V4's compressed caches: 4 or 128); 1 = one entry per token
    compress_ratio: int = 1

    def __post_init__(self) -> None:
        where = f"group {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"group name {self.name!r} must be a non-empty string")
        if self.kind not in KINDS:
            raise ConfigError(f"{where} has kind {self.kind!r}; use one of: {', '.join(KINDS)}")
        _positive_int(self.num_layers, f"{where} field 'num_layers'")
        _positive_int(self.tokens_per_block, f"{where} field 'tokens_per_block'")
        if self.kind == "state":
            _positive_int(self.state_bytes_per_layer, f"{where} field 'state_bytes_per_layer'")
            if self.bytes_per_token_per_layer:
                raise ConfigError(
                    f"{where} is a state group and cannot have 'bytes_per_token_per_layer'; "
                    "give 'state_bytes_per_layer' only"
                )
        else:
            _positive_int(
                self.bytes_per_token_per_layer, f"{where} field 'bytes_per_token_per_layer'"
            )
            if self.state_bytes_per_layer:
                raise ConfigError(
                    f"{where} has kind {self.kind!r} and cannot have 'state_bytes_per_layer'; "
                    "only kind 'state' has it"
                )
        if self.kind == "sliding":
            _positive_int(self.window, f"{where} field 'window' (sliding groups need it)")
        elif self.window is not None:
            raise ConfigError(f"{where} has a 'window' but kind {self.kind!r}; only 'sliding' has one")
        if self.kind == "chunked":
            _positive_int(
                self.attention_chunk, f"{where} field 'attention_chunk' (chunked groups need it)"
            )
        elif self.attention_chunk is not None:
            raise ConfigError(
                f"{where} has an 'attention_chunk' but kind {self.kind!r}; only 'chunked' has one"
            )
        _positive_int(self.compress_ratio, f"{where} field 'compress_ratio'")
        if self.compress_ratio > 1:
            if self.kind not in ("full", "mla"):
                raise ConfigError(
                    f"{where} has compress_ratio={self.compress_ratio} but kind {self.kind!r}; only "
                    "'full' and 'mla' groups (caches that keep every compressed entry) have one"
                )
            if self.tokens_per_block % self.compress_ratio:
                raise ConfigError(
                    f"{where} has tokens_per_block={self.tokens_per_block}, not a multiple of its "
                    f"compress_ratio={self.compress_ratio}; a block holds whole entries: use "
                    f"{self.compress_ratio * max(1, self.tokens_per_block // self.compress_ratio)}"
                )
        dtype_bytes(self.dtype)
        if not isinstance(self.cacheable, bool):
            raise ConfigError(f"{where} field 'cacheable' is {self.cacheable!r}; use true or false")
        if not isinstance(self.reason, str):
            raise ConfigError(f"{where} field 'reason' is {self.reason!r}; use a string")
        if not self.cacheable and not self.reason:
            raise ConfigError(f"{where} is not cacheable; give a 'reason' saying why")
        if not isinstance(self.layers, tuple):
            raise ConfigError(f"{where} field 'layers' must be a tuple of layer indices")
        if self.layers:
            for layer in self.layers:
                if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                    raise ConfigError(
                        f"{where} field 'layers' has {layer!r}; layer indices are integers >= 0"
                    )
            if len(set(self.layers)) != len(self.layers):
                raise ConfigError(f"{where} field 'layers' lists a layer twice: {list(self.layers)}")
            if len(self.layers) != self.num_layers:
                raise ConfigError(
                    f"{where} lists {len(self.layers)} layers in 'layers' but has "
                    f"num_layers={self.num_layers}; they must agree"
                )

    @property
    def is_state(self) -> bool:
        return self.kind == "state"

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers of the group (0 for state groups).
        A compressed group (`compress_ratio > 1`) has no whole bytes per token: use
        `bytes_for_tokens`."""
        if self.compress_ratio != 1:
            raise ConfigError(
                f"group {self.name!r} holds one entry per {self.compress_ratio} tokens; its size is "
                "bytes_for_tokens(n), not a per-token figure"
            )
        return self.bytes_per_token_per_layer * self.num_layers

    def bytes_for_tokens(self, tokens: int) -> int:
        """Bytes `tokens` tokens occupy across all layers of the group (0 for state groups).
        For a compressed group `tokens` is a multiple of `compress_ratio` (whole entries)."""
        if tokens % self.compress_ratio:
            raise ConfigError(
                f"group {self.name!r} holds one entry per {self.compress_ratio} tokens; {tokens} "
                "tokens is not a whole number of entries"
            )
        return tokens // self.compress_ratio * self.bytes_per_token_per_layer * self.num_layers

    @property
    def state_bytes(self) -> int:
        """Bytes of one state checkpoint across all layers (0 for attention groups)."""
        return self.state_bytes_per_layer * self.num_layers

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name,
            "kind": self.kind,
            "num_layers": self.num_layers,
            "tokens_per_block": self.tokens_per_block,
        }
        if self.kind == "state":
            out["state_bytes_per_layer"] = self.state_bytes_per_layer
        else:
            out["bytes_per_token_per_layer"] = self.bytes_per_token_per_layer
        if self.compress_ratio != 1:  # absent when 1: older geometries keep their fingerprints
            out["compress_ratio"] = self.compress_ratio
        if self.window is not None:
            out["window"] = self.window
        if self.attention_chunk is not None:
            out["attention_chunk"] = self.attention_chunk
        out["dtype"] = self.dtype
        if not self.cacheable:
            out["cacheable"] = False
            out["reason"] = self.reason
        if self.layers:
            out["layers"] = list(self.layers)
        return out

    @classmethod
    def from_dict(cls, data: object, where: str = "group") -> Group:
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}")
        name = data.get("name")
        label = f"{where} {name!r}" if isinstance(name, str) else where
        unknown = sorted(set(data) - _GROUP_FIELDS)
        if unknown:
            raise ConfigError(
                f"{label} has unknown field {unknown[0]!r}; known fields: {', '.join(sorted(_GROUP_FIELDS))}"
            )
        for required in ("name", "kind", "num_layers", "tokens_per_block"):
            if required not in data:
                raise ConfigError(f"{label} is missing field {required!r}")
        kind = data["kind"]
        if kind == "state" and "state_bytes_per_layer" not in data:
            raise ConfigError(f"{label} is missing field 'state_bytes_per_layer'")
        if kind in ATTENTION_KINDS and "bytes_per_token_per_layer" not in data:
            raise ConfigError(f"{label} is missing field 'bytes_per_token_per_layer'")
        return cls(
            name=data["name"],
            kind=kind,
            num_layers=data["num_layers"],
            tokens_per_block=data["tokens_per_block"],
            bytes_per_token_per_layer=data.get("bytes_per_token_per_layer", 0),
            state_bytes_per_layer=data.get("state_bytes_per_layer", 0),
            window=data.get("window"),
            attention_chunk=data.get("attention_chunk"),
            dtype=data.get("dtype", "bfloat16"),
            cacheable=data.get("cacheable", True),
            reason=data.get("reason", ""),
            layers=_layers_from_json(data.get("layers", ()), label),
            compress_ratio=data.get("compress_ratio", 1),
        )


@dataclass(frozen=True, slots=True)
class Geometry:
    """The groups of one model and the hash unit. Group order defines group indices."""

    groups: tuple[Group, ...]
    tokens_per_hash: int
    name: str = ""
    # how the geometry was read, e.g. "hf:gemma3" or "generic reading of model_type 'foo'";
    # shown to users, not part of the fingerprint.
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _positive_int(self.tokens_per_hash, "geometry field 'tokens_per_hash'")
        if not self.groups:
            raise ConfigError("geometry has no groups; give at least one in 'groups'")
        seen: set[str] = set()
        for g in self.groups:
            if not isinstance(g, Group):
                raise ConfigError(f"geometry groups must be Group values, got {type(g).__name__}")
            if g.name in seen:
                raise ConfigError(f"group name {g.name!r} appears twice; group names must be unique")
            seen.add(g.name)
        # A layer has at most one attention cache and one state (Falcon-H1 runs attention and
        # Mamba side by side in every layer, so its layers are in one group of each). DeepSeek V4
        # is the exception, recognised by its compressed groups: each of its layers holds a
        # sliding window, compressed entries, indexer keys and compressor states side by side.
        owner: dict[tuple[bool, int], str] = {}
        compressed = any(g.compress_ratio > 1 for g in self.groups)
        for g in () if compressed else self.groups:
            for layer in g.layers:
                slot = (g.is_state, layer)
                if slot in owner:
                    raise ConfigError(
                        f"layer {layer} is in group {owner[slot]!r} and in group {g.name!r}; a layer "
                        "belongs to at most one attention group and one state group"
                    )
                owner[slot] = g.name

    @property
    def cacheable_groups(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.cacheable)

    def group_index(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if g.name == name:
                return i
        raise ConfigError(
            f"no group named {name!r}; groups are: {', '.join(g.name for g in self.groups)}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "tokens_per_hash": self.tokens_per_hash,
            "groups": [g.to_dict() for g in self.groups],
        }

    def fingerprint(self) -> str:
        """A stable 16-hex-digit identity of the layout (not of the name or source).

        Two geometries with the same groups (order, kinds, sizes, dtypes, cacheability, layer
        indices when given) and the same hash unit have the same fingerprint in every process and Python version: it is a
        sha256 of canonical JSON, never Python's `hash`.
        """
        doc = self.to_dict()
        doc.pop("name")
        for g in doc["groups"]:  # type: ignore[union-attr]
            g.pop("name")  # renaming a group does not change the bytes it holds
            g.pop("reason", None)
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: object, source: str = "") -> Geometry:
        if not isinstance(data, dict):
            raise ConfigError(f"a geometry must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - _GEOMETRY_FIELDS)
        if unknown:
            raise ConfigError(
                f"geometry has unknown field {unknown[0]!r}; known fields: {', '.join(sorted(_GEOMETRY_FIELDS))}"
            )
        for required in ("tokens_per_hash", "groups"):
            if required not in data:
                raise ConfigError(f"geometry is missing field {required!r}")
        groups = data["groups"]
        if not isinstance(groups, list):
            raise ConfigError("geometry field 'groups' must be a list of group objects")
        name = data.get("name", "")
        if not isinstance(name, str):
            raise ConfigError(f"geometry field 'name' is {name!r}; use a string")
        return cls(
            groups=tuple(Group.from_dict(g, f"group #{i}") for i, g in enumerate(groups)),
            tokens_per_hash=data["tokens_per_hash"],
            name=name,
            source=source,
        )


def _layers_from_json(value: object, label: str) -> tuple[int, ...]:
    if isinstance(value, tuple):
        return value
    if not isinstance(value, list):
        raise ConfigError(f"{label} field 'layers' is {value!r}; give a list of layer indices")
    return tuple(value)


def _positive_int(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} is {value!r}; it must be a positive integer")
