"""`fuseguard verify --html`: one self-contained, well-formed page with the verdicts, stats, plots, groups."""

from __future__ import annotations

import base64
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuseguard.verify.cli import main

VOID = {"img", "meta", "br", "hr", "input", "link"}


class _Checker(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        for key, value in attrs:
            if key in ("src", "href") and value and not value.startswith(("data:", "#")):
                self.external.append(value)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def test_html_report_of_a_real_run(tmp_path: Path) -> None:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(8, np.float32), "b")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["a"]),
                           helper.make_node("Relu", ["a"], ["z"])],
                          "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 8])], [w, b])
    model = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    page = tmp_path / "report.html"
    assert main(["verify", str(model), "--html", str(page)]) == 0
    text = page.read_text()
    checker = _Checker()
    checker.feed(text)
    assert not checker.errors and not checker.stack, (checker.errors, checker.stack)
    assert not checker.external, checker.external             # self-contained: nothing to fetch
    assert "tiny" in text and "PASS" in text and "max |err|" in text and "fusion groups" in text
    images = re.findall(r"src='data:image/png;base64,([^']+)'", text)
    assert images and all(base64.b64decode(i).startswith(b"\x89PNG\r\n\x1a\n") for i in images)


def _bench_result(model: str, fused: float) -> dict:
    return {"model": model, "tvm_fused_ms": fused, "tvm_unfused_ms": 2 * fused, "ort_ms": 1.0, "ort_noopt_ms": 1.5,
            "fused_vs_ort": fused, "fusion_gain": 2.0, "fused_vs_ort_ci": (fused * 0.9, fused * 1.1),
            "fusion_gain_ci": (1.9, 2.1), "between_process_spread": 0.03, "kernels_fused": 3, "kernels_unfused": 9,
            "compile_s": 1.2, "unfused_compile_s": 0.8}


def test_bench_page_has_every_model_and_a_chart() -> None:
    from fuseguard.verify.html import render_bench

    page = render_bench([_bench_result("resnet50", 1.17), _bench_result("mlp_gelu", 0.8)], note="2 threads")
    assert page.count("<tr>") == 3 and "resnet50" in page and "1.17 (1.05-1.29)" in page
    assert page.count("data:image/png;base64,") == 1 and page.rstrip().endswith("</html>")


def test_gate_page_marks_regressions() -> None:
    from fuseguard.verify.html import render_gate

    ok = {"model": "m1", "verdict": "same", "gate": {"ratio": 1.01, "ci": (0.98, 1.04), "p_value": 0.4, "factor": 1.1},
          "base_ms": 1.0, "candidate_ms": 1.01, "ort_ms": 1.2, "compile_s": {"base": 3.0, "candidate": 3.1},
          "planned_bytes": {"base": 2**20, "candidate": 2**20}, "outputs_match": True, "resource_regressions": []}
    bad = {**ok, "model": "m2", "resource_regressions": ["compile time 3.0 s -> 4.0 s (1.33x)"]}
    page = render_gate([ok, bad], base="a" * 40)
    assert "<span class='PASS'>same</span>" in page and "<span class='FAIL'>same</span>" in page
    assert "compile time 3.0 s -&gt; 4.0 s" in page and "data:image/png;base64," in page


PLUGIN = Path(__file__).resolve().parent / "plugins" / "wrong_relu.py"


def _well_formed(text: str) -> list[bytes]:
    """Parse the page; return its embedded PNGs (each checked to be one)."""
    checker = _Checker()
    checker.feed(text)
    assert not checker.errors and not checker.stack, (checker.errors, checker.stack)
    assert not checker.external, checker.external
    images = [base64.b64decode(i) for i in re.findall(r"src='data:image/png;base64,([^']+)'", text)]
    assert images and all(i.startswith(b"\x89PNG\r\n\x1a\n") for i in images)
    return images


def test_bisect_page_names_the_drifting_group_and_its_onnx_nodes(tmp_path: Path) -> None:
    import json

    import subprocess
    import sys

    # In its own process: a plugin stays registered in the process that loaded it (later builds in this
    # pytest worker would get the wrong ReLU).
    page, out = tmp_path / "bisect.html", tmp_path / "bisect.json"
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "bisect", "conv_bn_relu", "--plugin", str(PLUGIN),
                           "--out", str(tmp_path / "repro"), "--json", str(out), "--html", str(page)],
                          cwd=PLUGIN.parents[2], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    # The failing comparison is kept (a failed CompareResult is falsy; the JSON had dropped it as None).
    assert result["fused_vs_reference"] is not None and result["fused_vs_reference"]["passed"] is False
    text = page.read_text()
    _well_formed(text)
    assert "culprit: fusion drift" in text and "conv2d_bias_act" in text and "the unfused build" in text
    for node, op_type in zip(result["culprit"]["onnx_nodes"], result["culprit"]["onnx_op_types"]):
        assert f"<td>{node}</td><td>{op_type}</td>" in text
    assert "fused vs ORT: FAIL" in text and "unfused vs ORT: PASS" in text and "repro.onnx" in text


def test_verify_profile_puts_each_group_beside_its_unfused_parts(tmp_path: Path) -> None:
    import json

    from fuseguard.verify.html import render_profile

    page, out = tmp_path / "verify.html", tmp_path / "verify.json"
    assert main(["verify", "conv_bn_relu", "--profile", "--json", str(out), "--html", str(page)]) == 0
    (model,) = json.loads(out.read_text())["models"]
    profile = model["profile"]
    timed = {g["kernel"] for g in profile["groups"] if g["parts"]}
    assert timed and timed <= {g["kernel"] for g in model["fused"]["report"]["groups"]} | {
        s["kernel"] for s in profile["fused"]}
    text = page.read_text()
    _well_formed(text)
    assert "unfused parts us" in text and "per-kernel profile" in text

    # A group slower than its parts is marked on the profile page.
    slow = next(g for g in profile["groups"] if g["parts"])
    slow["fused_us"] = 2 * slow["parts_us"]
    text = render_profile({model["model"]: profile})
    _well_formed(text)
    assert "<span class='FAIL'>0.50x</span>" in text and "% of sgemm" in text


def test_a_shared_kernel_shows_each_call_sites_own_time() -> None:
    """One PrimFunc called from three places is three report groups: each row gets its own call's time
    (matched by ONNX nodes), not the kernel's total three times over."""
    from fuseguard.verify.html import render_verify

    sites = [(["mm_a", "add_a"], 100.0, 150.0), (["mm_b", "add_b"], 200.0, 210.0), (["mm_c", "add_c"], 400.0, 300.0)]
    groups = [{"function": "fused_matmul_add", "kernel": "fused_matmul_add", "pattern": "generic",
               "ops": ["matmul", "add"], "onnx_nodes": nodes, "reason": "FuseOps"} for nodes, _, _ in sites]
    profile = {"groups": [{"kernel": "fused_matmul_add", "nodes": nodes, "fused_us": f, "parts_us": p,
                           "parts": ["matmul", "add"], "pattern": "generic"} for nodes, f, p in sites],
               "fused": [], "unfused": [], "fused_total_us": 700.0, "unfused_total_us": 660.0}
    page = render_verify([{"model": "m", "status": "PASS", "fused": {"report": {"groups": groups}}, "unfused": {},
                           "profile": profile}])
    _well_formed(page)
    for _, f, p in sites:
        assert f'<td class="num">{f:.3g}</td><td class="num">{p:.3g}</td>' in page
    assert "<span class='PASS'>1.50x</span>" in page and "<span class='FAIL'>0.75x</span>" in page
    assert ">700</td>" not in page        # the kernel's total is not shown against one call site


def _browser() -> str | None:
    import shutil

    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def test_pages_render_in_a_headless_browser(tmp_path: Path) -> None:
    """The pages open in a real browser and their embedded plots are painted (matplotlib's first colour,
    #1f77b4, fills the bars: a broken data URI shows an icon instead)."""
    import subprocess

    import pytest
    from PIL import Image

    from fuseguard.verify.html import render_bench

    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium here (Debian package `chromium`; .ci/run installs it where it can)")
    page = tmp_path / "bench.html"
    page.write_text(render_bench([_bench_result("resnet50", 1.17), _bench_result("mlp_gelu", 0.8)]))
    shot = tmp_path / "bench.png"
    proc = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1200,1400", f"--screenshot={shot}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int32)
    blue = int((np.abs(pixels - np.array([31, 119, 180])).sum(axis=-1) < 12).sum())
    assert blue > 2000, f"{blue} pixels of the chart's colour: the embedded plot was not painted"
