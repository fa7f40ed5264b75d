"""`python -m fuseguard.verify.devicecheck BUNDLE ...`: the device check's stable command (verify/device/check.py).

Imports nothing of TVM's: it runs on a GPU machine that has only Python, NumPy and the bundle."""

import os
import sys

from .device.check import main

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
