"""The prefix tree of chunk hashes, bounded: where requests branch and where they end.

A chained chunk hash names its whole prefix, so the tree is a map hash -> node. A *branch
point* is a node that gains a second distinct child: prompts that share a prefix and then
differ (a system prompt, a document asked about twice). Hits of later requests land there and at
the ends of earlier requests (a next turn repeats the previous prompt), which is what admission
of state checkpoints and sliding windows needs to know (docs/admission.md, "Admission where hits
land"). Used by the default rule (`kvtier.index.placement`) and replay's Marconi baseline.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ChunkHash = bytes | int
NODE_BYTES = 120  # a node: an ordered-dict entry holding [first child, depth, end offset]
ENDS = 8  # end offsets remembered: a node k chunks before a request's end, k < ENDS


class BranchTree:
    """Nodes hash -> [first child or None, depth, offset from the nearest request end seen (or
    ENDS)], at most `max_nodes`, least recently seen forgotten first. Memory: <= max_nodes x
    ~120 bytes."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max(1, max_nodes)
        self.nodes: OrderedDict[ChunkHash, list] = OrderedDict()

    def match(self, chunks: Sequence[ChunkHash]) -> int:
        """How many leading chunks of `chunks` the tree holds (the prefix seen before)."""
        nodes, k = self.nodes, 0
        while k < len(chunks) and chunks[k] in nodes:
            k += 1
        return k

    def end_offset(self, chunk_hash: ChunkHash) -> int:
        """How many chunks before an earlier request's end this node lies (ENDS: none near)."""
        node = self.nodes.get(chunk_hash)
        return node[2] if node is not None else ENDS

    def insert(self, chunks: Sequence[ChunkHash]) -> list[int]:
        """Add a request's path; returns the branch points it creates (chunk indices whose node
        had a child and now gains a second, distinct one)."""
        nodes, n = self.nodes, len(chunks)
        k = self.match(chunks)
        for i in range(k):
            nodes.move_to_end(chunks[i])
        for j in range(min(ENDS, n)):  # mark the ends, on old nodes too
            node = nodes.get(chunks[n - 1 - j])
            if node is not None and node[2] > j:
                node[2] = j
        if k == n:
            return []
        out = []
        if k > 0:
            parent = nodes[chunks[k - 1]]
            if parent[0] is None:
                parent[0] = chunks[k]  # a leaf extended (a follow-up turn): no branch
            elif parent[0] != chunks[k]:
                out.append(k - 1)
        for i in range(k, n):
            nodes[chunks[i]] = [chunks[i + 1] if i + 1 < n else None, i, min(ENDS, n - 1 - i)]
        while len(nodes) > self.max_nodes:
            nodes.popitem(last=False)
        return out

    def depth(self, chunk_hash: ChunkHash) -> int:
        node = self.nodes.get(chunk_hash)
        return node[1] if node is not None else 0

    @property
    def memory_bytes(self) -> int:
        return NODE_BYTES * len(self.nodes)
