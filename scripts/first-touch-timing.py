"""Why the vLLM worker faults its cpu tier's slabs in at start (store/tiers/factory.py, `fault_in`): the
time of one prompt's store (8 chunks of 30 layers x 96 KiB pages, SmolLM2-135M's shape at 128
tokens a block, one thread, index_select into slot rows as the worker copies) into slab rows
never touched before against rows already touched. Medians of 8 stores, side by side.

    .venv/bin/python scripts/first-touch-timing.py
"""

from __future__ import annotations

import statistics
import time

import torch

PAGE, LAYERS, BLOCKS, CHUNKS = 98304, 30, 64, 8


def main() -> None:
    torch.set_num_threads(1)
    kv = [torch.randint(0, 255, (BLOCKS, PAGE), dtype=torch.uint8) for _ in range(LAYERS)]

    def store(row: torch.Tensor, block: int) -> None:
        bids = torch.tensor([block])
        for layer, t in enumerate(kv):
            torch.index_select(t, 0, bids, out=row[layer * PAGE:(layer + 1) * PAGE].view(1, PAGE))

    out = {}
    for label, touch in (("fresh", False), ("touched", True)):
        slab = torch.empty((BLOCKS, LAYERS * PAGE), dtype=torch.uint8)
        if touch:
            slab.zero_()
        times = []
        for i in range(0, BLOCKS, CHUNKS):
            t0 = time.perf_counter()
            for j in range(CHUNKS):
                store(slab[i + j], i + j)
            times.append(time.perf_counter() - t0)
        out[label] = statistics.median(times) * 1e3
        print(f"{label:8s} store of {CHUNKS} chunks, median {out[label]:.2f} ms")
    print(f"fresh / touched: {out['fresh'] / out['touched']:.1f}x")


if __name__ == "__main__":
    main()
