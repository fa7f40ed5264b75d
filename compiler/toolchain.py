"""The toolchain as this process loaded it: TVM's and tvm-ffi's Python sources and native libraries, and LLVM.

Why: the build cache keyed on TVM's version string, and TVM's own developers work from a source tree first on
`PYTHONPATH` (TVM's documented set-up) whose version does not change with their edits, or rebuild `libtvm`
at the same version. A copy of the installed `tvm` with one line of its fusion code changed was served the
old build and passed; only `--no-cache` failed it. The fingerprint is what was imported, not what it calls
itself: every source and library file under the packages' folders, and every TVM library mapped into the
process (a `libtvm` outside the package: a source tree's `build/`, `TVM_LIBRARY_PATH`), each by
(relative path, size, mtime in ns, inode). Content hashing 320 MB of wheel would take seconds; a stat walk of
its ~3100 files takes ~20 ms (Zen 4 class, warm page cache), and an edit, a copy or a rebuilt library changes
mtime or inode. LLVM is linked into `libtvm_compiler` (so its file covers it); its major version is named too.
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

#: files that change what TVM does: Python sources and native libraries (not __pycache__, docs, headers)
_SUFFIXES = (".py", ".so", ".dylib", ".dll", ".pyd")


def _walk(folder: Path) -> tuple[int, str]:
    """(file count, digest) of the source and library files under `folder`, by path, size, mtime and inode."""
    h = hashlib.sha256()
    count = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(_SUFFIXES) and ".so." not in name:
                continue
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            h.update(f"{os.path.relpath(path, folder)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
            count += 1
    return count, h.hexdigest()[:16]


def _loaded_libraries() -> list[str]:
    """Every TVM native library this process has mapped (Linux's /proc/self/maps; elsewhere, those TVM's
    loader recorded)."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                base = os.path.basename(path)
                if path.startswith("/") and "tvm" in base and (".so" in base or base.endswith(".dylib")):
                    paths.add(path)
    except OSError:
        pass
    try:
        import tvm.base

        for lib in getattr(tvm.base, "_LOADED_LIBS", {}).values():
            name = getattr(lib, "_name", None)
            if name:
                paths.add(str(name))
    except Exception:  # noqa: BLE001 - an older TVM without the table: the maps are enough
        pass
    return sorted(paths)


def _file_id(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


@lru_cache(maxsize=1)
def fingerprint() -> dict[str, Any]:
    """What the build cache's key sees of the toolchain (module docstring); computed once per process, since a
    loaded module cannot change under it."""
    import tvm
    import tvm_ffi

    out: dict[str, Any] = {"python": sys.version.split()[0]}
    for label, module in (("tvm", tvm), ("tvm_ffi", tvm_ffi)):
        folder = Path(module.__file__).resolve().parent
        count, digest = _walk(folder)
        out[label] = {"version": str(getattr(module, "__version__", "?")), "path": str(folder),
                      "files": count, "digest": digest}
    libs = _loaded_libraries()
    out["libraries"] = {path: _file_id(path) for path in libs}
    try:
        out["llvm"] = int(tvm.target.codegen.llvm_version_major())
    except Exception:  # noqa: BLE001 - a TVM built without LLVM
        out["llvm"] = None
    return out


def digest() -> str:
    """One hash of `fingerprint()`, for the cache key."""
    fp = fingerprint()
    h = hashlib.sha256()
    for label in ("tvm", "tvm_ffi"):
        h.update(f"{label}:{fp[label]['version']}:{fp[label]['path']}:{fp[label]['digest']}\n".encode())
    for path, ident in fp["libraries"].items():
        h.update(f"{path}:{ident}\n".encode())
    h.update(f"llvm:{fp['llvm']}\n".encode())
    return h.hexdigest()[:16]


def describe() -> list[str]:
    """Lines for `fuseguard cache info`: what the key saw."""
    fp = fingerprint()
    lines = []
    for label in ("tvm", "tvm_ffi"):
        part = fp[label]
        lines.append(f"{label} {part['version']} from {part['path']} ({part['files']} source/library files, "
                     f"digest {part['digest']})")
    for path, ident in fp["libraries"].items():
        lines.append(f"library {path} (size:mtime_ns:inode {ident})")
    lines.append(f"LLVM {fp['llvm'] if fp['llvm'] is not None else 'not built in'}; toolchain key {digest()}")
    return lines
