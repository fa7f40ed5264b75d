"""A fusion bug for `fuseguard reduce`'s tests, loaded with --plugin: any fused group holding an Erf (the exact
GELU, imported as erf or nn.gelu) fails to build. Only the fused build has composite functions at the after_fusion stage."""

from tvm import relax

from fuseguard.compiler.pipeline import register_pass


def _calls_erf(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call) and
                                    getattr(e.op, "name", "") in ("relax.erf", "relax.nn.gelu") else None)
    return bool(found)


def fail_on_fused_erf(mod):
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and func.attrs is not None and "Composite" in func.attrs \
                and _calls_erf(func):
            raise RuntimeError(f"injected fault: cannot lower the fused group {gv.name_hint} holding erf")
    return mod


register_pass("after_fusion", fail_on_fused_erf, name="erf_breaks_fusion")
