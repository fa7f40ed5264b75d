"""Root conftest: fuseguard's pytest plugin (options --gpu-arch, --no-fusion, --disable-pattern, ...)."""

pytest_plugins = ["fuseguard.verify.pytest_plugin"]
