"""`fuseguard verify --html FILE`: one self-contained HTML page to look at (no network, no external files).

Per run: the verdict table. Per model: each output's error statistics for the fused and the unfused build
against ONNX Runtime, with a plot (median / mean / p99 / max absolute error of both builds on a log scale,
and each build's error histogram), the fusion groups with the reason for each decision (and the refused
matches), kernels, compile time, and memory traffic against the minimum. Plots are matplotlib PNGs
embedded as base64 data URIs, so the file can be mailed or attached to a CI run as it is.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:.6em 0 1.2em;max-width:100%}td{overflow-wrap:anywhere}td,th{border:1px solid #ccc;padding:.25em .6em;font-size:.9em}
th{background:#f3f3f3;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}
.PASS{color:#0a7d28;font-weight:600}.FAIL,.ERROR{color:#b3261e;font-weight:600}.COMPILED{color:#555}
h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}small{color:#666}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    return _e(x)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in numeric else ""
            if isinstance(cell, tuple) and cell and cell[0] == "raw":
                cells.append(f"<td{cls}>{cell[1]}</td>")
            else:
                cells.append(f"<td{cls}>{_fmt(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def png_data_uri(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _error_plot(name: str, fused: Mapping[str, Any] | None, unfused: Mapping[str, Any] | None, *,
                reference: str = "ORT", labels: tuple[str, str] = ("fused", "unfused")) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = ("median_abs_error", "mean_abs_error", "p99_abs_error", "max_abs_error")
    sides = [(label, d) for label, d in zip(labels, (fused, unfused)) if d and d.get("max_abs_error") is not None]
    if not sides:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 2.8))
    width = 0.38
    for k, (label, d) in enumerate(sides):
        values = [max(float(d.get(s) or 0.0), 1e-12) for s in stats]
        ax1.bar([i + (k - 0.5) * width for i in range(len(stats))], values, width, label=f"{label} vs {reference}")
        hist = d.get("abs_error_histogram")
        if hist:
            edges, counts = hist["edges"], hist["counts"]
            # Fused and unfused often agree bit for bit: the second line dashed over the first, both visible.
            ax2.stairs(counts, edges, label=f"{label} vs {reference}", lw=2.2 if k == 0 else 1.2,
                       ls="-" if k == 0 else "--")
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(stats)), ["median", "mean", "p99", "max"])
    ax1.set_ylabel("|error|")
    ax1.set_title(f"{name}: absolute error vs {reference}", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("|error|")
    ax2.set_ylabel("elements")
    ax2.set_yscale("log")
    ax2.set_title("error histograms", fontsize=9)
    ax2.legend(fontsize=7)
    return png_data_uri(fig)


def _compare_section(fc: Mapping[str, Any], uc: Mapping[str, Any], *, reference: str = "ORT",
                     labels: tuple[str, str] = ("fused", "unfused")) -> list[str]:
    """Per output, each side's error statistics against `reference` (one table) and a plot per output.
    `fc`/`uc` are `CompareResult.to_dict()["outputs"]` of the two sides (either may be empty)."""
    out: list[str] = []
    names = list(fc) or list(uc)
    stat_rows = []
    for o in names:
        for label, d in zip(labels, (fc.get(o), uc.get(o))):
            if d:
                ok = d.get("passed")
                stat_rows.append([o, label, "x".join(map(str, d.get("shape", []))), d.get("max_abs_error"),
                                  d.get("p99_abs_error"), d.get("mean_abs_error"), d.get("max_rel_error"),
                                  d.get("mismatches"), ("raw", f"<span class='{'PASS' if ok else 'FAIL'}'>"
                                                           f"{'pass' if ok else 'FAIL'}</span>")])
    if stat_rows:
        out.append(_table(["output", "build", "shape", "max |err|", "p99 |err|", "mean |err|", "max rel err",
                           "mismatches", ""], stat_rows, numeric=(3, 4, 5, 6, 7)))
    for o in names:
        img = _error_plot(o, fc.get(o), uc.get(o), reference=reference, labels=labels)
        if img:
            out.append(f"<img alt='errors of {_e(o)}' src='{img}'>")
    return out


def render_verify(results: Sequence[Mapping[str, Any]], *, title: str = "fuseguard verify",
                  target: str = "", note: str = "") -> str:
    """The page for `fuseguard verify --json`'s result dicts."""
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"
             f"<p><small>{_e(target)} &middot; {now}{' &middot; ' + _e(note) if note else ''}</small></p>"]
    rows = []
    for r in results:
        status = r.get("status", "ERROR")
        f, u = r.get("fused") or {}, r.get("unfused") or {}
        rows.append([("raw", f"<a href='#m{abs(hash(r.get('model', '')))}'>{_e(r.get('model', '?'))}</a>"),
                     r.get("nodes"), f.get("groups"), f.get("max_abs_error"), u.get("max_abs_error"),
                     ("raw", f"<span class='{_e(status)}'>{_e(status)}</span>"),
                     f"{_fmt(f.get('compile_s'))} / {_fmt(u.get('compile_s'))}"])
    parts.append(_table(["model", "nodes", "fused groups", "max err fused vs ORT", "max err unfused vs ORT",
                         "verdict", "compile s (fused / unfused)"], rows, numeric=(1, 2, 3, 4)))
    for r in results:
        parts.append(_model_section(r))
    parts.append("</body></html>")
    return "\n".join(parts)


def _model_section(r: Mapping[str, Any]) -> str:
    name = r.get("model", "?")
    out = [f"<h2 id='m{abs(hash(name))}'>{_e(name)} <span class='{_e(r.get('status', ''))}'>{_e(r.get('status', ''))}</span></h2>"]
    if r.get("error"):
        out.append(f"<p class='ERROR'>{_e(r['error'])}</p>")
        return "\n".join(out)
    f, u = r.get("fused") or {}, r.get("unfused") or {}
    shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in (r.get("input_shapes") or {}).items())
    out.append(f"<p><small>inputs {_e(shapes)} &middot; seed {_e(r.get('seed'))} &middot; target {_e(r.get('target'))}"
               f"</small></p>")
    for build in (f, u):
        if build.get("error"):
            out.append(f"<p class='ERROR'>{_e(build.get('config'))}: {_e(build['error'])}</p>")
    out += _compare_section((f.get("compare") or {}).get("outputs", {}), (u.get("compare") or {}).get("outputs", {}))
    rep = f.get("report") or {}
    if rep:
        traffic, minimum = rep.get("traffic_bytes") or 0, rep.get("min_traffic_bytes") or 0
        ur = u.get("report") or {}
        out.append(f"<p>kernels: fused {_e(rep.get('kernels'))}, unfused {_e(ur.get('kernels'))} &middot; memory "
                   f"traffic: fused {traffic / 2**20:.1f} MiB, unfused {(ur.get('traffic_bytes') or 0) / 2**20:.1f} MiB, "
                   f"minimum {minimum / 2**20:.1f} MiB"
                   + (f" (fused {traffic / minimum:.2f}x the minimum)" if minimum else "") + "</p>")
        prof = r.get("profile") or {}
        timed = _times_by_kernel(prof)
        groups, numeric = [], ()
        for g in rep.get("groups", []):
            row = [g.get("function"), g.get("pattern"), " + ".join(g.get("ops", [])), _nodes(g.get("onnx_nodes", [])),
                   rep.get("schedules", {}).get(g.get("kernel", ""), "")]
            if prof:
                kernel = g.get("kernel", "")
                fused_us, parts_us = timed.get((kernel, tuple(g.get("onnx_nodes") or ())),
                                               timed.get(kernel, (None, None)))
                row += [fused_us, parts_us, _speedup_cell(fused_us, parts_us)]
            groups.append(row + [g.get("reason")])
        extra = ["", "", ""] if prof else []
        groups += [["(not fused)", d.get("pattern"), " + ".join(d.get("ops", [])), _nodes(d.get("onnx_nodes", [])),
                    "", *extra, d.get("reason")] for d in rep.get("decisions", []) if not d.get("fused")]
        if groups:
            headers = ["group", "pattern", "ops", "ONNX nodes", "schedule"]
            if prof:
                headers += ["fused us", "unfused parts us", "parts / fused"]
                numeric = (5, 6, 7)
            out.append("<details open><summary>fusion groups and decisions</summary>")
            out.append(_table([*headers, "why"], groups, numeric=numeric))
            out.append("</details>")
    if r.get("profile"):
        out += _profile_section(r["profile"], table=False)
    return "\n".join(out)


def _nodes(nodes: Sequence[str], limit: int = 4) -> str:
    return ", ".join(nodes[:limit]) + (f" (+{len(nodes) - limit})" if len(nodes) > limit else "")


def _speedup_cell(fused_us: float | None, parts_us: float | None) -> Any:
    """parts / fused, red when the fused kernel is more than 5% slower than its parts (the profile's margin)."""
    if not fused_us or not parts_us:
        return None
    ratio = parts_us / fused_us
    return ("raw", f"<span class='{'FAIL' if ratio < 0.95 else 'PASS'}'>{ratio:.2f}x</span>")


def _times_by_kernel(profile: Mapping[str, Any]) -> dict[Any, tuple[float, float | None]]:
    """(kernel, ONNX nodes) -> (fused us, unfused parts us) per call site, and kernel -> the same summed over
    its call sites (a shared PrimFunc is one kernel called from several places; the report has a group per
    call site, matched by its ONNX nodes where they are known)."""
    out: dict[Any, tuple[float, float | None]] = {}
    for g in profile.get("groups", []):
        has_parts = g.get("parts") and g.get("parts_us") is not None
        parts_us = g["parts_us"] if has_parts else None
        out[(g["kernel"], tuple(g.get("nodes") or ()))] = (g["fused_us"], parts_us)
        fused, parts = out.get(g["kernel"], (0.0, None))
        out[g["kernel"]] = (fused + g["fused_us"], ((parts or 0.0) + parts_us) if has_parts else parts)
    return out


#: groups drawn in a profile's chart (slowest fused kernels first); the table lists them all.
PROFILE_CHART_GROUPS = 16


def _profile_plot(groups: Sequence[Mapping[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = sorted(groups, key=lambda g: -g["fused_us"])[:PROFILE_CHART_GROUPS][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(top) + 1.2))
    ys = range(len(top))
    ax.barh([y + 0.2 for y in ys], [g["fused_us"] for g in top], 0.4, label="fused kernel")
    ax.barh([y - 0.2 for y in ys], [g["parts_us"] if g.get("parts") else 0.0 for g in top], 0.4,
            label="its unfused parts")
    ax.set_yticks(list(ys), [f"{g['kernel'][:40]} ({g.get('pattern') or 'single'})" for g in top], fontsize=7)
    ax.set_xlabel("us per call")
    ax.legend(fontsize=7)
    return png_data_uri(fig)


def _profile_section(p: Mapping[str, Any], *, table: bool = True) -> list[str]:
    """One model's `ProfileResult.to_dict()`: totals, a chart of the slowest groups fused vs their unfused
    parts, and (with `table`) every group with bytes moved, GFLOP/s and its share of the run's sgemm peak."""
    fused_total, unfused_total = p.get("fused_total_us") or 0.0, p.get("unfused_total_us") or 0.0
    peak = p.get("peak_gflops") or 0.0
    groups = p.get("groups", [])
    slower = [g for g in groups if g.get("parts") and g["fused_us"] > g["parts_us"] * 1.05]
    out = [f"<h3>per-kernel profile</h3><p><small>{_e(p.get('cpu'))}, {_e(p.get('threads'))} threads, median of "
           f"{_e(p.get('repeats'))} runs; numpy sgemm {peak:.0f} GFLOP/s in the same run; the hook's "
           f"{_fmt(p.get('overhead_us'))} us a call subtracted, the VM's {_fmt(p.get('call_us'))} us a kernel call "
           f"added; groups too short for the hook timed by replay (each kernel "
           f"looped alone on its own arguments)</small></p>"
           f"<p>kernels: fused {len(p.get('fused', []))} in {fused_total:.1f} us, unfused {len(p.get('unfused', []))} "
           f"in {unfused_total:.1f} us" + (f" ({unfused_total / fused_total:.2f}x)" if fused_total else "")
           + f" &middot; {len(slower)} fused kernel(s) slower than their parts by more than 5%</p>"]
    if groups:
        out.append(f"<img alt='fused vs unfused per group' src='{_profile_plot(groups)}'>")
    if table and groups:
        rows = []
        for g in sorted(groups, key=lambda g: -g["fused_us"]):
            gf = g.get("gflops") or 0.0
            rows.append([g["kernel"], g.get("pattern"), _nodes(g.get("nodes", []), 3), g["fused_us"],
                         g["parts_us"] if g.get("parts") else None,
                         _speedup_cell(g["fused_us"], g["parts_us"] if g.get("parts") else None),
                         g.get("bytes", 0) / 1e6, gf if g.get("flops") else None,
                         f"{100 * gf / peak:.0f}%" if g.get("flops") and peak else None,
                         g.get("timing", "model run"), g.get("reason")])
        out.append(_table(["kernel", "pattern", "ONNX nodes", "fused us", "unfused parts us", "parts / fused",
                           "MB moved", "GFLOP/s", "% of sgemm", "timed by", "why"], rows, numeric=(3, 4, 5, 6, 7, 8)))
    return out


def render_profile(profiles: Mapping[str, Mapping[str, Any]], *, title: str = "fuseguard profile",
                   note: str = "") -> str:
    """The page for `fuseguard profile --json` (model -> `ProfileResult.to_dict()`)."""
    body = []
    for model, p in profiles.items():
        body.append(f"<h2>{_e(model)}</h2>")
        body += _profile_section(p)
    return _page(title, note, body)


def render_bisect(r: Mapping[str, Any], *, title: str = "fuseguard bisect") -> str:
    """The page for `BisectResult.to_dict()`: the verdict, both builds against ONNX Runtime per output, and
    each culprit: the group (pattern, ops, kernel), the ONNX nodes it came from, its error against the
    build it is compared with, whether its inputs agreed, and the reproducer to hand over."""
    status = r.get("status", "untestable")
    cls = {"no-drift": "PASS", "drift": "FAIL"}.get(status, "ERROR")
    body = [f"<p class='{cls}'>{_e(r.get('summary', status))}</p>",
            f"<p><small>{_e(r.get('builds'))} builds, {_fmt(r.get('seconds'))} s, {_e(r.get('compared'))} "
            f"intermediate tensors compared" + (f", {len(r['unmapped'])} fused kernels with no unfused counterpart"
                                                if r.get("unmapped") else "") + "</small></p>"]
    if r.get("error"):
        body.append(f"<p class='ERROR'>{_e(r['error'])}</p>")
    fused, unfused = r.get("fused_vs_reference") or {}, r.get("unfused_vs_reference") or {}
    if fused or unfused:
        body.append("<h2>model outputs</h2>")
        for label, res in (("fused vs ORT", fused), ("unfused vs ORT", unfused)):
            if res:
                body.append(f"<p>{_e(label)}: {_e(res.get('summary'))}</p>")
        body += _compare_section(fused.get("outputs", {}), unfused.get("outputs", {}))
    for c in [r.get("culprit"), *(r.get("other") or [])]:
        if not c:
            continue
        against = "the unfused build" if c.get("blame") == "fusion" else "ONNX Runtime"
        body.append(f"<h2>culprit: {_e(c.get('blame'))} drift <small>(found by {_e(c.get('via'))})</small></h2>")
        agree = {True: "yes", False: "NO", None: "unknown"}[c.get("inputs_agree")]
        inputs = ", ".join(f"{k}: {_fmt(v)}" for k, v in (c.get("input_errors") or {}).items())
        body.append(_table(["", ""], [
            ["kernel", f"{c['function']} -> {c['kernel']}" if c.get("function") else c.get("kernel")],
            ["pattern", c.get("pattern") or "(not fused: a single operator)"],
            ["ops", " + ".join(c.get("ops", []))],
            ["ONNX tensors", f"{', '.join(c.get('onnx_inputs', []))} -> {', '.join(c.get('onnx_outputs', []))}"],
            ["compared with", against],
            ["inputs agree", f"{agree} ({inputs})" if inputs else agree],
            ["why fused", c.get("reason") or "-"]]))
        body.append(_table(["ONNX node", "op type"], list(zip(c.get("onnx_nodes", []), c.get("onnx_op_types", [])))))
        err = c.get("error") or {}
        side = "fused" if c.get("blame") == "fusion" else "unfused"
        body += _compare_section({c.get("kernel", "?"): err}, {}, reference=against, labels=(side, ""))
    rep = r.get("reproducer")
    if rep:
        state = {True: "fails verify on its own", False: "passes verify on its own", None: "not checked"}
        body.append(f"<h2>reproducer</h2><p>{_e(rep.get('model'))} + {_e(rep.get('inputs'))} "
                    f"({_e(state[rep.get('confirmed')])})</p><pre>{_e(rep.get('command'))}</pre>"
                    + (f"<p><small>{_e(rep['detail'])}</small></p>" if rep.get("detail") else ""))
    for note in r.get("notes") or []:
        body.append(f"<p><small>note: {_e(note)}</small></p>")
    return _page(f"{title}: {r.get('model', '?')}", f"target {r.get('target', '')}", body)


def _page(title: str, note: str, body: Sequence[str]) -> str:
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return "\n".join([f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
                      f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"
                      f"<p><small>{now}{' &middot; ' + _e(note) if note else ''}</small></p>", *body, "</body></html>"])


def _ci(ci: Any) -> str:
    return f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"


def _ratio_plot(names: Sequence[str], series: Mapping[str, tuple[Sequence[float], Sequence[Any]]],
                line: float | None, ylabel: str) -> str:
    """Grouped bars per model, one per series (value, (lo, hi) interval or None), with a reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(names) + 2), 3.6))
    width = 0.8 / max(1, len(series))
    for i, (label, (values, cis)) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        err = [[max(0.0, v - (c[0] if c else v)) for v, c in zip(values, cis)],
               [max(0.0, (c[1] if c else v) - v) for v, c in zip(values, cis)]]
        ax.bar(xs, values, width, yerr=err, capsize=3, label=label)
    if line is not None:
        ax.axhline(line, color="#b3261e", lw=1, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    return png_data_uri(fig)


def render_bench(results: Sequence[Mapping[str, Any]], *, title: str = "fuseguard bench", note: str = "") -> str:
    """The page for `fuseguard bench --json`'s result dicts: times, ratios against ONNX Runtime measured in
    the same run (with their intervals), and a chart of both ratios per model."""
    rows = [[r["model"], r["tvm_fused_ms"], r["tvm_unfused_ms"], r["ort_ms"], r["ort_noopt_ms"],
             f"{r['fused_vs_ort']:.2f} ({_ci(r.get('fused_vs_ort_ci'))})",
             f"{r['fusion_gain']:.2f} ({_ci(r.get('fusion_gain_ci'))})", f"{r['between_process_spread']:.1%}",
             f"{r['kernels_fused']} / {r['kernels_unfused']}", f"{r['compile_s']:.1f} / {r['unfused_compile_s']:.1f}"]
            for r in results]
    body = [_table(["model", "TVM fused ms", "TVM unfused ms", "ORT ms", "ORT no-opt ms", "fused / ORT (95% CI)",
                    "unfused / fused (95% CI)", "spread between processes", "kernels fused / unfused",
                    "compile s fused / unfused"], rows, numeric=(1, 2, 3, 4))]
    if results:
        names = [r["model"].split("[", 1)[0] for r in results]
        body.append("<h2>ratios</h2><p>fused / ORT below the dashed line is faster than ONNX Runtime; "
                    "unfused / fused above it is fusion that pays.</p>")
        body.append(f"<img alt='ratios per model' src='{_ratio_plot(names, {'fused / ORT': ([r['fused_vs_ort'] for r in results], [r.get('fused_vs_ort_ci') for r in results]), 'unfused / fused': ([r['fusion_gain'] for r in results], [r.get('fusion_gain_ci') for r in results])}, 1.0, 'ratio')}'>")
    return _page(title, note, body)


def render_gate(results: Sequence[Mapping[str, Any]], *, base: str, title: str = "fuseguard gate",
                note: str = "") -> str:
    """The page for `fuseguard gate --json`: per model the verdict, the candidate/base ratio with its
    interval against the factor, times of both arms and ONNX Runtime, compile time, planned memory, outputs."""
    rows, names, ratios, cis = [], [], [], []
    factor = None
    for r in results:
        g = r.get("gate") or {}
        verdict = r.get("verdict", "error")
        cls = "FAIL" if verdict in ("slower", "error") or r.get("resource_regressions") else "PASS"
        comp, mem = r.get("compile_s") or {}, r.get("planned_bytes") or {}
        rows.append([r["model"], ("raw", f"<span class='{cls}'>{_e(verdict)}</span>"),
                     g.get("ratio"), _ci(g.get("ci")), g.get("p_value"), r.get("base_ms"), r.get("candidate_ms"),
                     r.get("ort_ms"), f"{_fmt(comp.get('base'))} / {_fmt(comp.get('candidate'))}",
                     f"{_fmt((mem.get('base') or 0) / 2**20)} / {_fmt((mem.get('candidate') or 0) / 2**20)}",
                     {True: "same", False: "CHANGED", None: "-"}[r.get("outputs_match")],
                     "; ".join(r.get("resource_regressions") or []) or r.get("error") or ""])
        if g.get("ratio") is not None:
            names.append(r["model"].split("[", 1)[0])
            ratios.append(g["ratio"])
            cis.append(g.get("ci"))
            factor = g.get("factor", factor)
    body = [_table(["model", "verdict", "candidate / base", "95% CI", "p", "base ms", "candidate ms", "ORT ms",
                    "compile s base / candidate", "planned MiB base / candidate", "outputs", "regressions"], rows,
                   numeric=(2, 4, 5, 6, 7))]
    if names:
        body.append(f"<h2>candidate / base</h2><p>the dashed line is the gate's factor ({_fmt(factor)}x).</p>"
                    f"<img alt='ratios' src='{_ratio_plot(names, {'candidate / base': (ratios, cis)}, factor, 'ratio')}'>")
    return _page(title, f"base {base[:12]}" + (f" · {note}" if note else ""), body)
