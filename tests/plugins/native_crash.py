"""A pass that dereferences NULL (a real SIGSEGV in native code) while compiling any model with a Conv group,
or hangs instead when FUSEGUARD_TEST_HANG is set: the run must report that model and go on."""

import ctypes
import os
import time

from tvm import relax

from fuseguard.compiler.pipeline import register_pass


def crash_on_conv(mod):
    if any(isinstance(f, relax.Function) and f.attrs is not None and "Composite" in f.attrs
           and "conv2d" in str(f.attrs["Composite"]) for f in mod.functions.values()):
        if os.environ.get("FUSEGUARD_TEST_HANG"):
            time.sleep(3600)
        ctypes.string_at(0)
    return mod


register_pass("after_fusion", crash_on_conv, name="native_crash")
