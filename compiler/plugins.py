"""Load user modules that register fusion patterns or passes (`--plugin` / `--fuseguard-plugin`).

Workers are separate processes, so the parent passes plugin names in FUSEGUARD_PLUGINS and each
worker imports them once before its first build.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from . import settings
from .errors import UsageError

ENV = "FUSEGUARD_PLUGINS"
_loaded: set[str] = set()


def load_plugins(names: Sequence[str]) -> None:
    for name in names:
        if not name or name in _loaded:
            continue
        try:
            if name.endswith(".py"):
                path = Path(name)
                if not path.is_file():
                    raise FileNotFoundError(f"no such file {name}")
                spec = importlib.util.spec_from_file_location(f"fuseguard_plugin_{path.stem}", path)
                module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
                spec.loader.exec_module(module)  # type: ignore[union-attr]
            else:
                importlib.import_module(name)
        except Exception as err:
            raise UsageError(f"plugin {name}: cannot import ({type(err).__name__}: {err})") from err
        _loaded.add(name)


def load_env_plugins() -> None:
    load_plugins(settings.items(ENV))


def env_for(names: Sequence[str]) -> dict[str, str]:
    """Environment for a worker that must see these plugins (file paths made absolute)."""
    resolved = [str(Path(n).resolve()) if n.endswith(".py") else n for n in names]
    return {ENV: ",".join(resolved)} if resolved else {}
