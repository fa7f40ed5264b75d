"""The old import names (`compiler`, `verify`, `suites`) as aliases of `fuseguard.compiler` and the rest.

fuseguard installs under one name, `fuseguard`, so it claims no generic top-level name in a user's
environment. Plugins written against the old names (`from compiler.patterns import register_pattern`, as
the README once said) keep working: once fuseguard is imported, importing `compiler.patterns` returns
the very module `fuseguard.compiler.patterns` (one registry, not a second copy), with a FutureWarning
(shown by default: plugin authors are users).

Not an alias where another tree's `compiler` comes first on `sys.path`: the A/B gate imports a base
revision's compiler by its folder name from that revision's tree (verify/perf/ab.py: build_arm), and that must
load the base's code, not this one's. Alias only when the folder found is this installation's own (a
checkout on `sys.path`) or none is found at all.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

OLD_NAMES = ("compiler", "verify", "suites")
_warned: set[str] = set()


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The target ran when it was imported."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    _fuseguard_aliases = True

    def __init__(self) -> None:
        self._own: dict[str, Path | None] = {}

    def _own_dir(self, top: str) -> Path | None:
        if top not in self._own:
            spec = importlib.util.find_spec(f"fuseguard.{top}")
            locations = list(spec.submodule_search_locations or []) if spec else []
            self._own[top] = Path(locations[0]).resolve() if locations else None
        return self._own[top]

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top not in OLD_NAMES:
            return None
        if fullname == top:
            found = importlib.machinery.PathFinder.find_spec(top, sys.path)
            own = self._own_dir(top)
            if own is None:
                return None
            if found is not None:
                locations = list(found.submodule_search_locations or [])
                if not locations or Path(locations[0]).resolve() != own:
                    return None                       # another tree's folder, or a module of that name
                    #                                   (someone else's): load that one as itself
        else:
            parent = sys.modules.get(top)
            if parent is None or not parent.__name__.startswith("fuseguard."):
                return None                           # the old name is a real (other) package here
        real = importlib.util.find_spec(f"fuseguard.{fullname}")
        if real is None:
            return None
        if top not in _warned:
            _warned.add(top)
            warnings.warn(f"`{top}` is fuseguard's old import name: import `fuseguard.{top}` instead "
                          f"(`from {fullname}.x import y` becomes `from fuseguard.{fullname}.x import y`); "
                          "the alias will be removed in a later release", FutureWarning, stacklevel=3)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real.name),
                                              is_package=real.submodule_search_locations is not None)


def install() -> None:
    """Put the alias finder first on `sys.meta_path`, once a process (any copy of this module counts)."""
    if not any(getattr(f, "_fuseguard_aliases", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
