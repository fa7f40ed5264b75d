"""fuseguard's pytest plugin: options, markers and fixtures in one place."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fuseguard")
    group.addoption("--gpu-arch", default=None, metavar="ARCH",
                    help="compile the suites for this CUDA architecture (sm_80, sm_86, sm_89, sm_90); "
                         "the device run is skipped when no CUDA device is present")
    group.addoption("--no-fusion", action="store_true", default=False,
                    help="build the 'fused' side with every fusion off (the unfused fallback)")
    group.addoption("--disable-pattern", action="append", default=[], metavar="NAME",
                    help="turn one fusion pattern off (repeatable)")
