"""Host CPU detection and the matching LLVM target.

Scheduled kernels run 1.6-1.7x faster with a specific ``-mcpu`` than with the generic x86-64 target,
so the pipeline targets the machine it runs on; the schedules also size their register tiles from
the vector width found here.  Everything is read from ``/proc/cpuinfo`` and ``/sys`` (never assumed),
and ``FUSEGUARD_MCPU`` overrides the CPU name (e.g. to cross-compile for another x86 host).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import tvm

from .. import settings

MCPU_ENV = "FUSEGUARD_MCPU"


@dataclass(frozen=True)
class HostCPU:
    """What the schedules need to know about the CPU: ISA level, cores and cache sizes."""

    mcpu: str
    cores: int
    features: frozenset[str] = field(default_factory=frozenset)
    vendor: str = ""
    model_name: str = ""
    family: int | None = None
    model: int | None = None
    l1d_bytes: int | None = None
    l2_bytes: int | None = None
    l3_bytes: int | None = None

    @property
    def vector_bits(self) -> int:
        """Widest SIMD register the schedules should target (bits)."""
        if "avx512f" in self.features:
            return 512
        if "avx2" in self.features or "avx" in self.features:
            return 256
        if self.features & {"sse2", "asimd", "neon"}:
            return 128
        return 128

    @property
    def fp32_lanes(self) -> int:
        return self.vector_bits // 32

    @property
    def vector_loads_per_cycle(self) -> int:
        """Full-width vector loads L1 serves a cycle: 2 on Intel cores with AVX-512 (two 512-bit load ports
        since Skylake-SP); 1 elsewhere (what Zen3's conv tiles measured; Zen4 splits a 512-bit load in two)."""
        return 2 if "avx512f" in self.features and not self.mcpu.startswith("znver") else 1

    @property
    def vector_registers(self) -> int:
        """Architectural SIMD registers: 32 with AVX-512 or on AArch64, 16 with AVX/SSE."""
        if "avx512f" in self.features or "asimd" in self.features:
            return 32
        return 16


def _parse_cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                blocks.append(cur)
                cur = {}
            continue
        if ":" in line:
            key, _, value = line.partition(":")
            cur[key.strip().lower()] = value.strip()
    if cur:
        blocks.append(cur)
    return blocks


def _amd_mcpu(family: int | None, model: int | None, flags: set[str]) -> str | None:
    if family == 0x17:  # Zen, Zen+, Zen 2
        return "znver2" if model is not None and model >= 0x30 else "znver1"
    if family == 0x19:  # Zen 3 / Zen 4
        if model is not None and (0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF):
            return "znver4"
        return "znver4" if "avx512f" in flags else "znver3"
    if family == 0x1A:  # Zen 5
        return "znver5" if "avx512f" in flags else "znver3"
    return None


def _intel_mcpu(flags: set[str]) -> str | None:
    # Feature-based: the family-6 model table is long and keeps growing; flags decide the ISA level.
    if "amx_tile" in flags or "avx512_fp16" in flags:
        return "sapphirerapids"
    if "avx512_vnni" in flags and ("avx512_vbmi2" in flags or "gfni" in flags):
        return "icelake-server"
    if "avx512_vnni" in flags:
        return "cascadelake"
    if "avx512f" in flags:
        return "skylake-avx512"
    if "avx_vnni" in flags and "avx2" in flags:
        return "alderlake"
    if {"avx2", "fma", "adx", "rdseed"} <= flags:
        return "skylake" if "clflushopt" in flags else "broadwell"
    if {"avx2", "fma"} <= flags:
        return "haswell"
    if "avx" in flags:
        return "sandybridge"
    return None


def mcpu_from_cpuinfo(text: str) -> tuple[str, dict[str, object]]:
    """Map a ``/proc/cpuinfo`` text to an LLVM ``-mcpu`` name plus the facts parsed on the way."""
    blocks = _parse_cpuinfo_blocks(text)
    first = blocks[0] if blocks else {}
    vendor = first.get("vendor_id", "")
    flags = set(first.get("flags", first.get("features", "")).split())
    model_name = first.get("model name", "")

    def _int(key: str) -> int | None:
        val = first.get(key)
        if val is None:
            return None
        try:
            return int(val, 0)
        except ValueError:
            return None

    family, model = _int("cpu family"), _int("model")
    facts: dict[str, object] = {
        "vendor": vendor,
        "model_name": model_name,
        "family": family,
        "model": model,
        "features": frozenset(flags),
        "processors": sum(1 for b in blocks if "processor" in b),
    }
    mcpu: str | None = None
    if vendor == "AuthenticAMD":
        mcpu = _amd_mcpu(family, model, flags)
    elif vendor == "GenuineIntel":
        mcpu = _intel_mcpu(flags)
    elif "CPU implementer" in text or "asimd" in flags:
        mcpu = "generic"  # AArch64: LLVM picks features from the triple; generic is always valid
    if mcpu is None:
        mcpu = "core-avx2" if {"avx2", "fma"} <= flags else "x86-64"
    return mcpu, facts


def _read_cache_sizes(cpu_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[str, int]:
    sizes: dict[str, int] = {}
    if not cpu_dir.is_dir():
        return sizes
    for idx in sorted(cpu_dir.glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            ctype = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if not m:
            continue
        nbytes = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]
        if level == "1" and ctype in ("Data", "Unified"):
            sizes["l1d"] = nbytes
        elif level == "2":
            sizes["l2"] = nbytes
        elif level == "3":
            sizes["l3"] = nbytes
    return sizes


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def _host_facts() -> tuple[str, dict[str, object], dict[str, int], int]:
    """``/proc/cpuinfo``, the cache sizes and the usable cores, read once a process: every build asked."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    mcpu, facts = mcpu_from_cpuinfo(text)
    return mcpu, facts, _read_cache_sizes(), usable_cores()


def detect_host(cpuinfo_text: str | None = None) -> HostCPU:
    """Describe the host CPU; ``cpuinfo_text`` replaces ``/proc/cpuinfo`` (tests use canned texts).
    The only reader of ``/proc/cpuinfo`` and the cache sizes (compiler/hw/hardware.py asks here)."""
    if cpuinfo_text is None:
        mcpu, facts, caches, cores = _host_facts()
    else:
        (mcpu, facts), caches, cores = mcpu_from_cpuinfo(cpuinfo_text), {}, 0
    if not cores:
        cores = int(facts["processors"]) or 1  # type: ignore[arg-type]
    override = settings.get(MCPU_ENV)
    if override:
        mcpu = override
    return HostCPU(
        mcpu=mcpu,
        cores=cores,
        features=facts["features"],  # type: ignore[arg-type]
        vendor=str(facts["vendor"]),
        model_name=str(facts["model_name"]),
        family=facts["family"],  # type: ignore[arg-type]
        model=facts["model"],  # type: ignore[arg-type]
        l1d_bytes=caches.get("l1d"),
        l2_bytes=caches.get("l2"),
        l3_bytes=caches.get("l3"),
    )


def llvm_host_name() -> str:
    """LLVM's own name for the host CPU (what the per-class baseline files are named by; it can differ
    from the detected `mcpu` where cpuinfo names a CPU LLVM does not know)."""
    from tvm.target import codegen

    return str(codegen.llvm_get_system_cpu())


def host_target(mcpu: str | None = None, num_cores: int | None = None) -> tvm.target.Target:
    """LLVM target for this host (``FUSEGUARD_MCPU`` wins over detection, an explicit ``mcpu`` over both)."""
    host = detect_host()
    cpu = mcpu or host.mcpu
    try:
        from tvm.target import codegen

        if not codegen.llvm_is_valid_cpu(cpu, tvm.target.Target("llvm")):
            cpu = "core-avx2" if {"avx2", "fma"} <= host.features else "x86-64"
    except Exception:  # noqa: BLE001 - older builds lack the query; keep the detected name
        pass
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": int(num_cores or host.cores)})


def host_from_target(target: tvm.target.Target) -> HostCPU:
    """Host facts for scheduling against ``target``: detection, corrected by the target's mcpu/num-cores.

    When the target names a CPU other than the host's (cross-compilation), vector width follows the
    target's mcpu as LLVM reports it, so tiles fit the machine the code will run on.
    """
    host = detect_host()
    attrs = target.attrs
    cores = int(attrs["num-cores"]) if "num-cores" in attrs else host.cores
    mcpu = str(attrs["mcpu"]) if "mcpu" in attrs else host.mcpu
    features = set(host.features)
    if "mcpu" in attrs:
        try:
            from tvm.target import codegen

            # llvm_get_vector_width reports 512 for every x86 CPU here; ask for the features instead.
            # (cpuinfo's name, LLVM's): the VNNI ones decide the int8 kernels (schedule/cpu_matmul_int8.py)
            for feat, llvm_feat in (("avx512f", "avx512f"), ("avx2", "avx2"), ("fma", "fma"), ("avx", "avx"),
                                    ("avx512vl", "avx512vl"), ("avx512_vnni", "avx512vnni"),
                                    ("avx_vnni", "avxvnni")):
                if codegen.llvm_cpu_has_features(llvm_feat, target):
                    features.add(feat)
                else:
                    features.discard(feat)
        except Exception:  # noqa: BLE001
            pass
    return HostCPU(
        mcpu=mcpu,
        cores=max(1, cores),
        features=frozenset(features),
        vendor=host.vendor,
        model_name=host.model_name,
        family=host.family,
        model=host.model,
        l1d_bytes=host.l1d_bytes,
        l2_bytes=host.l2_bytes,
        l3_bytes=host.l3_bytes,
    )
