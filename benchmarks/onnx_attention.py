"""ONNX's own Attention op (opset 23): fuseguard fused and unfused against ONNX Runtime's Attention kernel.

Why: the op arrives as one node (torch's exporter writes SDPA so at opset 23+); fuseguard imports it
(compiler/frontend/converters/attention.py) in the form its attention pattern fuses into the tiled kernel. This writes one
model per case (Q/K/V [1, heads, S, 64] as graph inputs) and times them with `fuseguard bench`: exported
builds in fresh processes, ORT in the same processes, ratios with 95% intervals.

    python benchmarks/onnx_attention.py                      # causal S=128 and 512, a float mask at S=128
    python benchmarks/onnx_attention.py --processes 5 --repeats 9
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx
from onnx import TensorProto, helper

CASES = {  # name: (heads, seq, head_dim, causal, float mask input)
    "sdpa_causal_12x128x64": (12, 128, 64, 1, False),
    "sdpa_mask_12x128x64": (12, 128, 64, 0, True),
    "sdpa_causal_12x512x64": (12, 512, 64, 1, False),
}


def write_model(path: Path, heads: int, seq: int, dim: int, causal: int, mask: bool) -> None:
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, heads, seq, dim]) for n in "QKV"]
    names = ["Q", "K", "V"]
    if mask:
        inputs.append(helper.make_tensor_value_info("attn_mask", TensorProto.FLOAT, [1, 1, seq, seq]))
        names.append("attn_mask")
    node = helper.make_node("Attention", names, ["Y"], is_causal=causal)
    graph = helper.make_graph([node], path.stem, inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, heads, seq, dim])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name, case in CASES.items():
            paths.append(Path(tmp) / f"{name}.onnx")
            write_model(paths[-1], *case)
        return subprocess.call([sys.executable, "-m", "fuseguard.verify.cli", "bench", *map(str, paths),
                                "--processes", str(args.processes), "--repeats", str(args.repeats)])


if __name__ == "__main__":
    sys.exit(main())
