"""fuseguard's model suites (`fuseguard.suites`): built-in models, the real-export zoo and the pytest suites."""

import fuseguard.compiler  # noqa: F401  (installs the old-name aliases, compiler/_aliases.py)
