"""`python -m fuseguard.verify.cli ...`: the `fuseguard` command."""

import sys

from . import main

sys.exit(main())
