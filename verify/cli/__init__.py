"""The `fuseguard` command line: `main` dispatches each sub-command to its handler (cli/app.py).

One file per group of sub-commands: verify.py (`verify`, `compile`), perf.py (`bench`, `baseline`, `gate`,
`profile`, `tune`), tools.py (`reduce`, `conformance`, `cache`, `device-bundle`, `patterns`, `env`);
`bisect` is verify/debug/bisect/cli.py; what they share is common.py.

Exit codes: 0 all passed, 1 an output mismatched (or a build crashed), 2 unusable input or usage,
3 fuseguard itself failed. Errors are one line on stderr; `--debug` adds the traceback.
"""

from .app import build_parser, main
from .common import EXIT_INTERNAL, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE

__all__ = ["EXIT_INTERNAL", "EXIT_MISMATCH", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]
