"""Root conftest: fuseguard's pytest plugin (options --gpu-arch, --no-fusion, --disable-pattern, ...)."""

pytest_plugins = ["verify.pytest_plugin"]
