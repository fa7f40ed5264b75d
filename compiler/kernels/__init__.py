"""Hand-written TIR kernels that replace whole subgraphs the generic fusion path handles badly."""

from .attention import (
    CPU_DEFAULT_SCRATCH_BYTES,
    CUDA_DEFAULT_SHARED_BYTES,
    allocated_buffers,
    attention_call,
    attention_primfunc,
    attention_scratch_bytes,
    attention_smem_bytes,
    choose_tiles,
    cuda_max_shared_bytes,
    host_target,
)

__all__ = [
    "CPU_DEFAULT_SCRATCH_BYTES",
    "CUDA_DEFAULT_SHARED_BYTES",
    "allocated_buffers",
    "attention_call",
    "attention_primfunc",
    "attention_scratch_bytes",
    "attention_smem_bytes",
    "choose_tiles",
    "cuda_max_shared_bytes",
    "host_target",
]
