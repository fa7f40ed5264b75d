"""`fuseguard reduce`: a model whose build fails shrinks to the fewest nodes failing the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from fuseguard.verify.debug.reduce import Graph, reduce_nodes, signature_of

ROOT = Path(__file__).resolve().parent.parent
ERF = ROOT / "tests" / "plugins" / "erf_breaks_fusion.py"


def test_signature_ignores_names_and_numbers_not_the_kind_of_failure() -> None:
    a = signature_of("error", "CompileError", "m: node 'conv_12' failed at /tmp/x/candidate3.onnx: 64 != 3", "fused", "m")
    b = signature_of("error", "CompileError", "m: node 'add_1' failed at /tmp/y/original.onnx: 8 != 7", "fused", "m")
    assert a == b
    assert a != signature_of("error", "TVMError", "m: node 'add_1' failed at x.onnx: 8 != 7", "fused", "m")
    assert a != signature_of("error", "CompileError", "m: cannot schedule 'x'", "fused", "m")


def _chain() -> onnx.ModelProto:
    """x -> Relu -> Neg -> Abs -> Sigmoid -> y; the check below "fails" whenever an Abs is kept."""
    nodes = [helper.make_node(op, [i], [o], name=f"{op.lower()}_node")
             for op, i, o in (("Relu", "x", "a"), ("Neg", "a", "b"), ("Abs", "b", "c"), ("Sigmoid", "c", "y"))]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_cut_makes_boundary_tensors_inputs_and_outputs_and_the_search_is_one_minimal() -> None:
    graph = Graph.of(_chain())
    middle = graph.cut([1, 2])
    onnx.checker.check_model(middle, full_check=True)
    assert [i.name for i in middle.graph.input] == ["a"] and [o.name for o in middle.graph.output] == ["c"]
    target = signature_of("error", "E", "abs is broken", "fused", "m")
    seen: list[list[str]] = []

    def fails(model: onnx.ModelProto):
        ops = [n.op_type for n in model.graph.node]
        seen.append(ops)
        return target if "Abs" in ops else None

    keep, checks = reduce_nodes(graph, target, fails, progress=lambda _m: None)
    assert [graph.nodes[i].op_type for i in keep] == ["Abs"] and checks == len(seen) <= 8


def test_cli_reduces_a_failing_fused_build_and_the_reproducer_reproduces(tmp_path: Path) -> None:
    out = tmp_path / "red"
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "reduce", "bert_encoder", "--plugin", str(ERF),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "reduce.json").read_text())
    assert doc["confirmed"] and doc["original_nodes"] >= 30
    assert "Erf" in doc["ops"] and len(doc["ops"]) <= 8, doc["ops"]
    assert doc["signature"]["config"] == "fused" and "injected fault" in doc["signature"]["message"]
    reduced = onnx.load(str(out / "reduced.onnx"))
    onnx.checker.check_model(reduced)
    assert len(reduced.graph.node) == len(doc["ops"])
    # Without the faulty plugin the reproducer builds: nothing to reduce, said in one line.
    clean = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "reduce", str(out / "reduced.onnx"), "--out",
                            str(tmp_path / "again")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert clean.returncode == 0 and "nothing to reduce" in clean.stdout, clean.stdout + clean.stderr
