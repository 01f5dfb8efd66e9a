"""Which engine can restore how much of a prompt, from vLLM's KV events alone.

A KV-aware router (llm-d's precise prefix-cache scorer, Dynamo's KV router) sends a request to
the engine that holds the longest prefix of it. For a hybrid model "holds" is per group: a
sliding-window group keeps only the chunks of the last window before a boundary, a state group
only checkpoints, so a prefix whose chunk hashes are all present may still restore nothing. This
package keeps, per engine, what kvtier's events say each tier holds in each group, and answers the
prefix vLLM would restore (lookup.py: its offloading scheduler's own rule).

Input: vLLM's KV event stream (`--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'`), whose `BlockStored` / `BlockRemoved` events kvtier fills
(integrations/vllm/events.py):
- `kv_cache_spec_kind` / `kv_cache_spec_sliding_window`: the group's residency rule (for chunked
  local attention the window field carries its local chunk);
- `block_size`: the group's tokens per block; every chunk carries its `token_ids` (its length is
  the group's chunk span: groups of one model may differ, Gemma 4's and DeepSeek V4's do) and its
  `parent_block_hash`: the chain of hashes a prompt is matched against (a chunk's hash is the last
  of its `block_hashes`; every group's chunk ending at the same token has the same hash);
- `medium` / `ownership`: the tier ("CPU" = kvtier's cpu tier, "STORAGE" + "kvtier-disk" /
  "kvtier-redis").
GPU prefix-cache events (medium "GPU") are counted and ignored: this index predicts what kvtier
restores, which is what the engine loads when its GPU cache does not hold the prefix.

Hostile input (anyone who reaches a publisher's port may send anything): every field is checked
in `parse_event` (events.py); a bad event is skipped and counted per engine
(`PrefixIndex.stats`), never raised. `Limits` caps what one engine makes the router keep; a
restart, a gap in the sequence numbers (unless replayed) or a geometry change mid-stream resets
that engine. Whatever is refused, the router predicts less, never more. Deployment: docs/vllm.md,
"KV events".

No vLLM import: events are decoded as plain msgpack maps (`msgspec`), so this runs in a router
process of any vLLM version. `kvtier events --zmq ENDPOINT` prints what arrives and answers
queries.
"""

from __future__ import annotations

from .events import (CHUNKED_KINDS, FULL_KINDS, SLIDING_KINDS, STATE_KINDS, Event, Limits, decode_batch,
                     parse_event, tier_of)
from .index import PrefixIndex, Restorable, rule
from .lookup import GroupRule, hit_tokens
from .subscriber import Subscriber, log

__all__ = ["CHUNKED_KINDS", "FULL_KINDS", "SLIDING_KINDS", "STATE_KINDS", "Event", "GroupRule", "Limits",
           "PrefixIndex", "Restorable", "Subscriber", "decode_batch", "hit_tokens", "log", "parse_event",
           "rule", "tier_of"]
