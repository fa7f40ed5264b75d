"""`python -m fuseguard.verify.devicecheck BUNDLE ...`: the device check's stable command (verify/device/check.py).

Imports nothing of TVM's: it runs on a GPU machine that has only Python, NumPy and the bundle. The one
`__main__` of the check, so `device/check.py` can sit with the bundle code it pairs with."""

import os
import sys

from .device.check import main

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
