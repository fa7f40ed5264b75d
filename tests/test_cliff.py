"""`fuseguard bench MODEL --dynamic ... --dim ...` (verify/perf/cliff.py): what it builds and times, not how fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fuseguard.compiler.dynamic import parse_dynamic
from fuseguard.compiler.pipeline import CompileOptions
from fuseguard.verify.perf.cliff import bench_cliff, bucket_for
from fuseguard.verify.check.model import SuiteSpec

ROOT = Path(__file__).resolve().parent.parent


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_size() -> None:
    assert [bucket_for(s, [64, 16, 128]) for s in (1, 16, 17, 128, 129)] == [16, 16, 64, 128, None]


def test_cliff_times_each_size_on_its_own_static_build_and_on_its_bucket() -> None:
    result = bench_cliff(SuiteSpec("softmax_layernorm"), options=CompileOptions(dynamic=parse_dynamic("seq")),
                         sizes={"seq": [5, 16, 40]}, threads=1, repeats=1, buckets={"seq": [16]})
    assert [r.sizes for r in result.rows] == [{"seq": 5}, {"seq": 16}, {"seq": 40}]
    assert [r.bucket for r in result.rows] == [{"seq": 16}, {"seq": 16}, None]   # 40: no bucket holds it
    assert all(r.dynamic_ms > 0 and r.static_ms > 0 and r.ort_ms > 0 for r in result.rows)
    assert result.rows[0].bucket_ms > 0 and result.rows[2].bucket_ms is None
    data = json.loads(json.dumps(result.to_dict()))
    assert data["buckets"] == {"seq": [16]} and data["rows"][2]["bucket_vs_dynamic"] is None


def test_buckets_need_a_dynamic_dim() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "bench", "softmax_layernorm", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    alone = run("--buckets", "16,64")
    assert alone.returncode == 2 and "give --dynamic NAME too" in alone.stderr, alone.stderr
    wrong = run("--dynamic", "seq", "--dim", "seq=16", "--buckets", "batch=4")
    assert wrong.returncode == 2 and "--buckets 'batch=4'" in wrong.stderr, wrong.stderr
    assert "Traceback" not in alone.stderr + wrong.stderr
