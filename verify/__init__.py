"""fuseguard's verifier and harness (`fuseguard.verify`): the CLI, workers, comparison, timing and gates."""

import fuseguard.compiler  # noqa: F401  (installs the old-name aliases, compiler/_aliases.py)
