"""Targets: the host CPU (LLVM, detected `mcpu`) or a CUDA architecture (sm_80, sm_86, sm_89, sm_90)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import tvm

from .. import settings
from ..errors import UsageError
from .hostcpu import MCPU_ENV, usable_cores
from .hardware import SUPPORTED_GPU_ARCHS

_ARCH = re.compile(r"^sm_(\d{2,3})a?$")


@dataclass(frozen=True)
class TargetSpec:
    kind: str                 # "llvm" or "cuda"
    arch: str                 # mcpu for llvm, sm_XX for cuda
    num_cores: int | None = None

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def label(self) -> str:
        return self.arch if self.is_gpu else f"cpu ({self.arch})"

    @property
    def class_id(self) -> str:
        """The architecture's file stem for per-architecture data (baselines, measured decisions):
        `sm_80`, or `cpu-<mcpu>-<cores>c` (LLVM's CPU name plus usable cores)."""
        return self.arch if self.is_gpu else f"cpu-{self.arch.strip().lower()}-{self.num_cores or 1}c"

    def tvm_target(self) -> tvm.target.Target:
        if self.is_gpu:
            from .hardware import for_target

            hw = for_target("cuda", self.arch)
            # dlight tiles to these; without them it warns and assumes 48 KiB. Static shared memory is
            # capped at 48 KiB per block (more needs the dynamic opt-in), so that is the honest figure.
            return tvm.target.Target({"kind": "cuda", "arch": self.arch, "max_threads_per_block": 1024,
                                      "max_shared_memory_per_block": hw.smem_static_limit,
                                      "registers_per_block": hw.regs_per_sm, "thread_warp_size": 32})
        config: dict[str, object] = {"kind": "llvm"}
        if self.arch and self.arch != "generic":
            config["mcpu"] = self.arch
        if self.num_cores:
            config["num-cores"] = self.num_cores
        return tvm.target.Target(config)


def detect_mcpu() -> str:
    """The LLVM mcpu for this host (FUSEGUARD_MCPU overrides); the detection lives in compiler.hw.hostcpu."""
    env = settings.get(MCPU_ENV)
    if env:
        return env
    try:
        from .hostcpu import detect_host

        return detect_host().mcpu
    except Exception:  # detection is best-effort; the generic target is always correct
        return "generic"


def host_cores() -> int:
    return usable_cores()


def resolve(gpu_arch: str | None = None, mcpu: str | None = None) -> TargetSpec:
    if gpu_arch:
        m = _ARCH.match(gpu_arch)
        if not m:
            raise UsageError(f"--gpu-arch {gpu_arch!r}: expected sm_XX, one of {', '.join(SUPPORTED_GPU_ARCHS)}")
        if int(m.group(1)) < 70:
            raise UsageError(f"--gpu-arch {gpu_arch}: architectures older than sm_70 are not supported")
        return TargetSpec("cuda", gpu_arch)
    return TargetSpec("llvm", mcpu or detect_mcpu(), host_cores())


def cuda_device_present() -> bool:
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no CUDA runtime in this TVM build is the same as no device
        return False
