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
table{border-collapse:collapse;margin:.6em 0 1.2em}td,th{border:1px solid #ccc;padding:.25em .6em;font-size:.9em}
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


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _error_plot(name: str, fused: Mapping[str, Any] | None, unfused: Mapping[str, Any] | None) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = ("median_abs_error", "mean_abs_error", "p99_abs_error", "max_abs_error")
    sides = [(label, d) for label, d in (("fused", fused), ("unfused", unfused)) if d and d.get("max_abs_error") is not None]
    if not sides:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 2.8))
    width = 0.38
    for k, (label, d) in enumerate(sides):
        values = [max(float(d.get(s) or 0.0), 1e-12) for s in stats]
        ax1.bar([i + (k - 0.5) * width for i in range(len(stats))], values, width, label=f"{label} vs ORT")
        hist = d.get("abs_error_histogram")
        if hist:
            edges, counts = hist["edges"], hist["counts"]
            ax2.stairs(counts, edges, label=f"{label} vs ORT")
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(stats)), ["median", "mean", "p99", "max"])
    ax1.set_ylabel("|error|")
    ax1.set_title(f"{name}: absolute error vs ONNX Runtime", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("|error|")
    ax2.set_ylabel("elements")
    ax2.set_yscale("log")
    ax2.set_title("error histograms", fontsize=9)
    ax2.legend(fontsize=7)
    return _png(fig)


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
    fc, uc = (f.get("compare") or {}).get("outputs", {}), (u.get("compare") or {}).get("outputs", {})
    names = list(fc) or list(uc)
    stat_rows = []
    for o in names:
        for label, d in (("fused", fc.get(o)), ("unfused", uc.get(o))):
            if d:
                stat_rows.append([o, label, "x".join(map(str, d.get("shape", []))), d.get("max_abs_error"),
                                  d.get("p99_abs_error"), d.get("mean_abs_error"), d.get("max_rel_error"),
                                  d.get("mismatches"), ("raw", f"<span class='{'PASS' if d.get('passed') else 'FAIL'}'>"
                                                           f"{'pass' if d.get('passed') else 'FAIL'}</span>")])
    if stat_rows:
        out.append(_table(["output", "build", "shape", "max |err|", "p99 |err|", "mean |err|", "max rel err",
                           "mismatches", ""], stat_rows, numeric=(3, 4, 5, 6, 7)))
    for o in names:
        img = _error_plot(o, fc.get(o), uc.get(o))
        if img:
            out.append(f"<img alt='errors of {_e(o)}' src='{img}'>")
    rep = f.get("report") or {}
    if rep:
        traffic, minimum = rep.get("traffic_bytes") or 0, rep.get("min_traffic_bytes") or 0
        ur = u.get("report") or {}
        out.append(f"<p>kernels: fused {_e(rep.get('kernels'))}, unfused {_e(ur.get('kernels'))} &middot; memory "
                   f"traffic: fused {traffic / 2**20:.1f} MiB, unfused {(ur.get('traffic_bytes') or 0) / 2**20:.1f} MiB, "
                   f"minimum {minimum / 2**20:.1f} MiB"
                   + (f" (fused {traffic / minimum:.2f}x the minimum)" if minimum else "") + "</p>")
        groups = [[g.get("function"), g.get("pattern"), " + ".join(g.get("ops", [])),
                   ", ".join(g.get("onnx_nodes", [])[:4]) + (f" (+{len(g['onnx_nodes']) - 4})" if len(g.get("onnx_nodes", [])) > 4 else ""),
                   rep.get("schedules", {}).get(g.get("kernel", ""), ""), g.get("reason")]
                  for g in rep.get("groups", [])]
        groups += [["(not fused)", d.get("pattern"), " + ".join(d.get("ops", [])), ", ".join(d.get("onnx_nodes", [])[:4]),
                    "", d.get("reason")] for d in rep.get("decisions", []) if not d.get("fused")]
        if groups:
            out.append("<details open><summary>fusion groups and decisions</summary>")
            out.append(_table(["group", "pattern", "ops", "ONNX nodes", "schedule", "why"], groups))
            out.append("</details>")
    return "\n".join(out)


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
    return _png(fig)


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
