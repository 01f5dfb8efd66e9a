"""Request traces for `kvtier replay`: Mooncake JSONL and a generic JSONL format.

One request a line, a JSON object. Fields:
- `hash_ids`: chained prefix ids, one per block of `block_tokens` tokens (Mooncake: 512). Equal
  ids mean an equal prefix through that block. The last id of a request counts as a full block
  (Mooncake's convention: its last block is usually partial, but it is cached like the others).
- or `token_ids`: the prompt's token ids. They are hashed with `kvtier.core.keys` (the store's own
  chained hashing) in a replay namespace; only full chunks count, and a hit is at most
  prompt length - 1 tokens (the store's rule).
- `timestamp` (optional, any unit; default: the line number): requests replay in timestamp
  order, ties in file order.
- `input_length` (optional): prompt tokens, for the token hit rate. Default: blocks * block
  size (hash ids) or the number of token ids.
Other fields (Mooncake's `output_length`) are ignored.

Blocks to chunks (hash ids). With B = block_tokens and C = chunk_tokens:
- C a multiple of B (k = C / B): chunk i is named by the id of its last block, hash_ids[(i+1)k - 1];
  trailing blocks that do not fill a chunk are not stored and not counted.
- B a multiple of C (m = B / C): block j is split into m chunks named (id, 0..m-1) (as the int
  id * m + s); requests that differ in block j share none of its chunks (the trace cannot say
  more).
- otherwise: an error naming the chunk sizes that work.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.index.index import ChunkHash
from kvtier.core.plan import Plan

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Request:
    timestamp: float
    chunks: tuple[ChunkHash, ...]  # chunk hashes, prefix order, full chunks only
    prompt_tokens: int  # the hit rule's P (hit <= P - 1)
    input_tokens: int  # for the token hit rate


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[Request, ...]
    unique_chunks: int
    total_chunks: int
    total_input_tokens: int


def chunks_from_hash_ids(hash_ids: Sequence[int], block_tokens: int, chunk_tokens: int) -> tuple[int, ...]:
    if chunk_tokens % block_tokens == 0:
        k = chunk_tokens // block_tokens
        if k == 1:
            return tuple(hash_ids)
        return tuple(hash_ids[k - 1 :: k])
    if block_tokens % chunk_tokens == 0:
        m = block_tokens // chunk_tokens
        return tuple(h * m + s for h in hash_ids for s in range(m))
    raise ConfigError(
        f"chunk_tokens={chunk_tokens} and the trace's {block_tokens}-token blocks do not nest; use "
        f"a chunk size that divides {block_tokens} or is a multiple of it (e.g. {block_tokens})"
    )


def load_trace(path: str | Path, plan: Plan, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
               limit: int | None = None) -> Trace:
    """Read a trace file into requests mapped onto `plan`'s chunks, in replay order."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"trace file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read trace file {str(path)!r}: {exc}") from None
    c = plan.chunk_tokens
    if block_tokens <= 0:
        raise ConfigError(f"--trace-block-tokens {block_tokens} must be a positive integer")
    namespace = None
    rows: list[tuple[float, int, Request]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(rows) >= limit:
            break
        where = f"{p.name} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} is not JSON ({exc.msg}); one JSON object a line") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where} is not a JSON object")
        ts = obj.get("timestamp", lineno)
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise ConfigError(f"{where}: timestamp {ts!r} is not a number")
        if "hash_ids" in obj:
            ids = obj["hash_ids"]
            if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
                raise ConfigError(f"{where}: hash_ids must be a list of integers")
            chunks = chunks_from_hash_ids(ids, block_tokens, c)
            prompt = len(chunks) * c + 1  # the last chunk may hit (Mooncake convention)
            default_len = len(ids) * block_tokens
        elif "token_ids" in obj:
            toks = obj["token_ids"]
            if not isinstance(toks, list):
                raise ConfigError(f"{where}: token_ids must be a list of integers")
            if namespace is None:
                from kvtier.core.keys import Namespace

                namespace = Namespace("kvtier-replay", plan.geometry.fingerprint(), "replay")
            from kvtier.core.keys import chunk_hashes

            try:
                chunks = tuple(chunk_hashes(plan, namespace, toks))
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            prompt = len(toks)
            default_len = len(toks)
        else:
            raise ConfigError(
                f"{where} has neither 'hash_ids' nor 'token_ids'; see `kvtier replay --help` for "
                "the trace format"
            )
        length = obj.get("input_length", default_len)
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ConfigError(f"{where}: input_length {length!r} is not a non-negative integer")
        rows.append((float(ts), len(rows), Request(float(ts), chunks, prompt, length)))
    if not rows:
        raise ConfigError(f"trace file {str(path)!r} has no requests")
    rows.sort(key=lambda r: (r[0], r[1]))
    requests = tuple(r[2] for r in rows)
    unique = len({h for r in requests for h in r.chunks})
    return Trace(
        name=p.name,
        requests=requests,
        unique_chunks=unique,
        total_chunks=sum(len(r.chunks) for r in requests),
        total_input_tokens=sum(r.input_tokens for r in requests),
    )
