"""A vLLM general plugin for the suite's engines: the block copies between KV caches and host
buffers that vLLM's CUDA, ROCm and XPU platforms have and its CPU platform lacks.

`copy_kv_blocks`, the copy operation vLLM hands connectors (`set_host_xfer_buffer_ops`),
calls `current_platform.insert_blocks_to_device` and `swap_out_blocks_to_host`. The bodies
below are those of vLLM's GPU platforms, which are device-agnostic torch code; with them the
CPU engines of the suite run vLLM's own copy operation when rd2h stages KV through host
buffers (the test-only `test_stage_host_caches` setting). vLLM loads the plugin in every
process through its `vllm.general_plugins` entry point (the dist-info directory next to it).
"""

import torch


def insert_blocks_to_device(cls, src_cache: torch.Tensor, dst_cache: torch.Tensor,
                            src_block_indices: torch.Tensor,
                            dst_block_indices: torch.Tensor) -> None:
    _src_cache = src_cache[src_block_indices]
    dst_cache[dst_block_indices] = _src_cache.to(dst_cache.device)


def swap_out_blocks_to_host(cls, src_cache: torch.Tensor, dst_cache: torch.Tensor,
                            src_block_indices: torch.Tensor,
                            dst_block_indices: torch.Tensor) -> None:
    _src_cache = src_cache[src_block_indices]
    dst_cache[dst_block_indices] = _src_cache.cpu()


def register() -> None:
    from vllm.platforms.cpu import CpuPlatform

    for f in (insert_blocks_to_device, swap_out_blocks_to_host):
        if not hasattr(CpuPlatform, f.__name__):
            setattr(CpuPlatform, f.__name__, classmethod(f))
