"""Stand-in for vLLM's compiled extension on a machine that has only vLLM's Python code (the
device check): registers torch.ops._C_cache_ops.swap_blocks_batch as a loop of
cudaMemcpyAsync (cupy) on the current stream. Correct, not fast: GB/s measured through it are
the stand-in's, not vLLM's kernel's."""
import torch

_lib = torch.library.Library("_C_cache_ops", "DEF")
_lib.define("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, bool any_order=False) -> ()")


def _swap(src_ptrs, dst_ptrs, sizes, any_order=False):
    import cupy

    stream = torch.cuda.current_stream().cuda_stream
    for s, d, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        cupy.cuda.runtime.memcpyAsync(d, s, n, 4, stream)  # 4: cudaMemcpyDefault


_lib.impl("swap_blocks_batch", _swap, "CompositeExplicitAutograd")
