"""Running CUDA builds: the kernels are compiled by the same nvcc, with the same flags, as the SASS check.

TVM's CUDA module keeps the kernels' CUDA source (this wheel has no CUDA runtime at build time) and
compiles it when the library is loaded on a GPU, through the global `tvm_callback_cuda_compile`. TVM's own
callback needs NVIDIA's `cuda-bindings` for NVRTC, which fuseguard does not install; this one calls the
`cuda-tools` nvcc (compiler/cuda/sass.py) for the device's own architecture, so what ran is what was checked
offline whenever the build's `--gpu-arch` is the device's. `FUSEGUARD_CUDA_ARCH` overrides the architecture.
"""

from __future__ import annotations


from .. import settings
from ..errors import CompileError

_installed: list[str] = []      # non-empty once the callback is registered


def device_arch() -> str:
    """`sm_XX` of CUDA device 0 (or `FUSEGUARD_CUDA_ARCH`)."""
    env = settings.get("FUSEGUARD_CUDA_ARCH")
    if env:
        return env
    import tvm

    dev = tvm.cuda(0)
    if not dev.exist:
        raise CompileError("no CUDA device to compile the kernels for (set FUSEGUARD_CUDA_ARCH=sm_XX)", stage="jit")
    return "sm_" + str(dev.compute_version).replace(".", "")


def compile_for_device(code: str, arch: str | None = None) -> bytes:
    """The cubin of TVM-generated CUDA `code` for `arch` (default: the device's)."""
    from .sass import compile_cubin, require_toolkit

    cubin, _, _ = compile_cubin(code, arch or device_arch(), require_toolkit())
    return cubin


def install() -> bool:
    """Register `tvm_callback_cuda_compile` to use nvcc; False (TVM's own left in place) without a toolkit."""
    if _installed:
        return True
    from .sass import find_toolkit

    if find_toolkit() is None:
        return False
    import tvm_ffi

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", lambda code, *_: compile_for_device(code), override=True)
    _installed.append("nvcc")
    return True
