"""CUDA kernels compiled to SASS for a real architecture, offline, and their resources read back.

TVM emits CUDA C without a GPU, but "compiles to source" says nothing about whether a kernel fits the
architecture: it may not compile at all (an input named `gpu_0/data_0` became a parameter `gpu_0/data_0_ptr`),
spill registers to local memory, or ask for more registers or shared memory than a block may have. NVIDIA's
`nvcc`/`ptxas` run on any x86 machine: each generated source is compiled with `nvcc --cubin -arch=sm_XX` and
`ptxas -v`'s resource lines (registers, spills, stack, static shared memory, barriers) are joined with what
only TVM knows: the block size (`__launch_bounds__`), the grid and the dynamic shared memory of each kernel.

The toolkit is found at `FUSEGUARD_NVCC`, under `FUSEGUARD_CUDA_HOME`, `CUDA_PATH` or `CUDA_HOME`, in the pip
wheels of the `cuda-tools` extra (`site-packages/nvidia/cu13`), on `PATH`, or in /usr/local/cuda. Results are
cached by the hash of source, architecture, flags and toolkit version (`FUSEGUARD_CACHE_DIR/sass`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import settings
from ..errors import CompileError, UsageError
from ..hw.hardware import Hardware
from .occupancy import launch_problems, occupancy
from ..paths import enabled, home

#: nvcc flags: TVM's own CUDA compile path uses --use_fast_math and ptxas -O3 (its default).
NVCC_FLAGS = ("--cubin", "-O3", "--use_fast_math", "-w")
#: ptxas flags when TVM's own list cannot be read. TVM passes --register-usage-level=10 (its default,
#: TVM_CUDA_PTXAS_REG_LEVEL): at ptxas's default of 5, seven of ShuffleNet's conv kernels spilled 8 bytes
#: on sm_90 and none did at 10, so the check must use the flags the real build uses.
PTXAS_FLAGS_FALLBACK = ("-v", "--register-usage-level=10", "--warn-on-local-memory-usage")


def ptxas_flags() -> tuple[str, ...]:
    """The ptxas flags TVM's CUDA compile uses (tvm.support.nvcc), `-v` always among them."""
    try:
        from tvm.support import nvcc as tvm_nvcc

        flags = tuple(tvm_nvcc._ptxas_option_flags())
    except Exception:  # a TVM without that helper: the same defaults, spelled out here
        flags = PTXAS_FLAGS_FALLBACK
    return flags if "-v" in flags else ("-v", *flags)


def nvcc_flags(arch: str) -> list[str]:
    return [*NVCC_FLAGS, "-Xptxas", ",".join(ptxas_flags()), f"-arch={arch}"]
#: Seconds one nvcc run may take (DenseNet-121's 577 unfused kernels: 19 s on a Zen4 core).
NVCC_TIMEOUT_S = 600
#: Bump when the cached record's layout changes.
FORMAT = 1

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")
_LAUNCH_BOUNDS = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(')
_KERNEL_SUFFIX = re.compile(r"_kernel(?:_?\d+)?$")
_VERSION = re.compile(r"release (\d+\.\d+), V([\d.]+)")


@dataclass(frozen=True)
class Toolkit:
    nvcc: str
    version: str                  # "13.0.88"


def _candidates() -> list[Path]:
    out: list[Path] = []
    nvcc = settings.path("FUSEGUARD_NVCC")
    if nvcc:
        out.append(nvcc)
    for env in ("FUSEGUARD_CUDA_HOME", "CUDA_PATH", "CUDA_HOME"):
        home = settings.path(env)
        if home:
            out.append(home / "bin" / "nvcc")
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels (the cuda-tools extra)

        out += [Path(p) / "cu13" / "bin" / "nvcc" for p in getattr(nvidia, "__path__", [])]
    except ImportError:
        pass
    found = shutil.which("nvcc")
    if found:
        out.append(Path(found))
    out.append(Path("/usr/local/cuda/bin/nvcc"))
    return out


@lru_cache(maxsize=1)
def find_toolkit() -> Toolkit | None:
    """The first nvcc that runs and says its version; None when there is none."""
    for path in _candidates():
        if not path.is_file() or not os.access(path, os.X_OK):
            continue
        try:
            out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        m = _VERSION.search(out)
        if m:
            return Toolkit(str(path), m.group(2))
    return None


def require_toolkit() -> Toolkit:
    tk = find_toolkit()
    if tk is None:
        raise UsageError("no CUDA toolkit (nvcc) found: install fuseguard's 'cuda-tools' extra "
                         "(pip install -e '.[cuda-tools]') or set FUSEGUARD_CUDA_HOME to a CUDA 13.0 toolkit")
    return tk


@dataclass
class KernelResources:
    kernel: str                   # the CUDA kernel (`<PrimFunc>_kernel`)
    function: str                 # the PrimFunc it came from
    group: str = ""               # the pattern that made it ("generic" for FuseOps, "" when none)
    schedule: str = ""            # the rule that scheduled its PrimFunc (dlight.gpu.Matmul, ...)
    threads: int = 0              # per block (`__launch_bounds__`, which TVM sets to the block size)
    grid: int | None = None       # blocks launched (None when symbolic)
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0          # local memory per thread (stack frame), spills included
    static_smem: int = 0
    dynamic_smem: int = 0
    barriers: int = 0
    occupancy: float = 0.0
    occupancy_limit: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


@dataclass
class SassReport:
    """Every kernel of one build compiled for one architecture; truthy when none has a problem."""

    arch: str
    toolkit: str                  # nvcc version
    flags: list[str]
    kernels: list[KernelResources] = field(default_factory=list)
    compile_s: float = 0.0
    cached: bool = False

    def __bool__(self) -> bool:
        return not self.problems()

    def problems(self) -> list[KernelResources]:
        return [k for k in self.kernels if k.problems]

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, "toolkit": self.toolkit, "flags": list(self.flags), "compile_s": self.compile_s,
                "cached": self.cached, "kernels": [asdict(k) for k in self.kernels]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SassReport":
        return cls(arch=d["arch"], toolkit=d["toolkit"], flags=list(d["flags"]), compile_s=d.get("compile_s", 0.0),
                   cached=d.get("cached", False), kernels=[KernelResources(**k) for k in d.get("kernels", [])])

    def render(self, *, max_rows: int = 400) -> "object":
        from rich.table import Table

        bad = len(self.problems())
        table = Table(title=f"kernels on {self.arch} (nvcc {self.toolkit}): {len(self.kernels)} kernels, "
                            f"{bad} with problems; occupancy is unvalidated until measured on a GPU")
        for col in ("kernel", "group", "schedule", "threads", "blocks", "regs", "spill st/ld", "stack",
                    "smem st+dyn", "occupancy", "problem"):
            table.add_column(col, overflow="fold")
        for k in sorted(self.kernels, key=lambda k: (not k.problems, k.occupancy))[:max_rows]:
            table.add_row(k.kernel, k.group, k.schedule.removeprefix("dlight.gpu."), str(k.threads), "?" if k.grid is None else str(k.grid),
                          str(k.registers), f"{k.spill_stores}/{k.spill_loads}", str(k.stack_bytes),
                          f"{k.static_smem}+{k.dynamic_smem}", f"{k.occupancy:.0%} ({k.occupancy_limit})",
                          "; ".join(k.problems))
        return table


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """`ptxas -v` output -> {kernel: registers, spill_stores, spill_loads, stack_bytes, static_smem, barriers}."""
    out: dict[str, dict[str, int]] = {}
    starts = list(_ENTRY.finditer(log))
    for i, m in enumerate(starts):
        chunk = log[m.end(): starts[i + 1].start() if i + 1 < len(starts) else len(log)]
        props, used = _PROPS.search(chunk), _USED.search(chunk)
        barriers, smem = _BARRIERS.search(chunk), _SMEM.search(chunk)
        out[m.group(1)] = {
            "registers": int(used.group(1)) if used else 0,
            "stack_bytes": int(props.group(1)) if props else 0,
            "spill_stores": int(props.group(2)) if props else 0,
            "spill_loads": int(props.group(3)) if props else 0,
            "static_smem": int(smem.group(1)) if smem else 0,
            "barriers": int(barriers.group(1)) if barriers else 0,
        }
    return out


def launch_bounds(source: str) -> dict[str, int]:
    """Threads per block of each kernel defined in a TVM CUDA source."""
    return {m.group(2): int(m.group(1)) for m in _LAUNCH_BOUNDS.finditer(source)}


def function_of(kernel: str) -> str:
    return _KERNEL_SUFFIX.sub("", kernel)


def tir_launch_info(mod: Any) -> dict[str, tuple[int | None, int]]:
    """{PrimFunc: (blocks launched or None when symbolic, dynamic shared memory bytes)} from the module
    handed to codegen (thread bindings and `shared.dyn` buffers are still visible there)."""
    import tvm
    import tvm_ffi
    from tvm import s_tir, tirx

    out: dict[str, tuple[int | None, int]] = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        blocks: dict[str, int | None] = {}
        dyn: dict[int, int] = {}

        def visit_for(loop: Any) -> None:
            binding = loop.thread_binding
            if binding is not None and str(binding.thread_tag).startswith("blockIdx"):
                ext = loop.extent
                blocks[str(binding.thread_tag)] = int(ext.value) if isinstance(ext, tirx.IntImm) else None

        def visit_buffer(buf: Any) -> None:
            if buf.scope() == "shared.dyn":
                n = 1
                for d in buf.shape:
                    n = n * int(d.value) if isinstance(d, tirx.IntImm) else 0
                dt = tvm.DataType(str(buf.dtype))
                dyn[str(buf.name)] = n * ((dt.bits * dt.lanes + 7) // 8)

        def visit_block(block: Any) -> None:
            for buf in block.alloc_buffers:
                visit_buffer(buf)

        tvm_ffi.structural_walk(func, [(tirx.For, visit_for), (tirx.AllocBuffer, lambda n: visit_buffer(n.buffer)),
                                       (s_tir.SBlock, visit_block)])
        grid: int | None = 1
        for ext in blocks.values():
            grid = None if grid is None or ext is None else grid * ext
        out[gv.name_hint] = (grid if blocks else 1, sum(dyn.values()))
    return out


def compile_cubin(source: str, arch: str, tk: Toolkit) -> tuple[bytes, str, float]:
    """`source` compiled to a cubin for `arch`: (the cubin, ptxas's log, seconds)."""
    with tempfile.TemporaryDirectory(prefix="fuseguard-sass-") as tmp:
        cu = Path(tmp) / "kernels.cu"
        cu.write_text(source)
        cmd = [tk.nvcc, *nvcc_flags(arch), "-o", str(Path(tmp) / "kernels.cubin"), str(cu)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except subprocess.TimeoutExpired as err:
            raise CompileError(f"nvcc for {arch} ran past {NVCC_TIMEOUT_S} s", stage="sass") from err
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            errors = [ln.strip() for ln in proc.stderr.splitlines() if "error" in ln]
            first = errors[0] if errors else (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise CompileError(f"the generated CUDA does not compile for {arch} with nvcc {tk.version}: "
                               f"{first[:300]} ({len(errors)} error line(s))", stage="sass")
        return (Path(tmp) / "kernels.cubin").read_bytes(), proc.stdout + proc.stderr, elapsed


def _cache_dir() -> Path:
    return home() / "sass"


def _cached_log(source: str, arch: str, tk: Toolkit) -> tuple[str, float, bool]:
    key = hashlib.sha256(json.dumps([FORMAT, tk.version, nvcc_flags(arch), source]).encode()).hexdigest()
    path = _cache_dir() / f"{key}.json"
    if enabled() and path.is_file():
        try:
            d = json.loads(path.read_text())
            return d["log"], d["compile_s"], True
        except (OSError, ValueError, KeyError):
            pass
    _, log, elapsed = compile_cubin(source, arch, tk)
    if enabled():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"log": log, "compile_s": elapsed}))
            os.replace(tmp, path)
        except OSError:
            pass
    return log, elapsed, False


def check(source: str, lowered: Any, arch: str, hw: Hardware, groups: dict[str, str] | None = None,
          schedules: dict[str, str] | None = None, toolkit: Toolkit | None = None) -> SassReport:
    """Compile `source` (one build's CUDA) for `arch` and read every kernel's resources; `groups` maps a
    PrimFunc to the pattern that made it, `schedules` to the rule that scheduled it. A kernel that spills
    or cannot launch carries its problems."""
    tk = toolkit or require_toolkit()
    log, elapsed, cached = _cached_log(source, arch, tk)
    usage = parse_ptxas(log)
    threads = launch_bounds(source)
    tir = tir_launch_info(lowered) if lowered is not None else {}
    rep = SassReport(arch=arch, toolkit=tk.version, flags=nvcc_flags(arch), compile_s=elapsed,
                     cached=cached)
    for kernel, u in usage.items():
        func = function_of(kernel)
        grid, dyn = tir.get(func, (None, 0))
        k = KernelResources(kernel=kernel, function=func, group=(groups or {}).get(func, ""),
                            schedule=(schedules or {}).get(func, ""),
                            threads=threads.get(kernel, 0), grid=grid, dynamic_smem=dyn, **u)
        occ = occupancy(hw, k.threads, k.registers, k.static_smem + k.dynamic_smem)
        k.occupancy, k.occupancy_limit = occ.fraction, occ.limit
        k.problems = launch_problems(hw, k.threads, k.registers, k.static_smem, k.dynamic_smem)
        if k.spills:
            k.problems.append(f"spills registers ({k.spill_stores} bytes stored, {k.spill_loads} loaded)")
        rep.kernels.append(k)
    return rep
