"""A corpus of bad ONNX inputs, each with the CLI arguments that exercise it and what the CLI must say.

Every case is something a user can hand `fuseguard verify`: a broken or hostile file, a model TVM
cannot import, or flags that do not fit the model. `build_corpus(dir)` writes the files into `dir`
(one sub-folder per case, so external-data cases cannot see each other's files); the tests run each
through the real CLI, and `python tests/badmodels.py --write docs/bad-inputs.md` regenerates the
table there from the CLI's actual output (one CLI run per case, so each exit code is its own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
OPSET = 17


@dataclass(frozen=True)
class BadCase:
    """One bad input: how to build it, how to run it, and what the one-line message must contain."""

    name: str
    what: str                                   # the row label in docs/bad-inputs.md
    model: str                                  # file to verify, relative to the case folder
    args: tuple[str, ...] = ()                  # extra CLI arguments ({dir} is the case folder)
    expect: tuple[str, ...] = ()                # substrings of the error line (case-insensitive)
    exit_codes: tuple[int, ...] = (2,)
    warning: bool = False                       # a `fuseguard: warning:` line instead of an error


@dataclass
class CliResult:
    case: BadCase
    folder: Path
    returncode: int
    stdout: str
    stderr: str
    argv: list[str] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- model builders

def _model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
           outputs: Sequence[onnx.ValueInfoProto], inits: Sequence[onnx.TensorProto] = (),
           opsets: Sequence[tuple[str, int]] = (("", OPSET),), ir_version: int = 8) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "bad", list(inputs), list(outputs), list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = ir_version
    return model


def _vi(name: str, dims: Sequence[int | str], elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(dims))


def conv_model(weight: np.ndarray | None = None) -> onnx.ModelProto:
    """A valid Conv -> Relu model with a 64 KiB weight: truncating it cuts the weight in half."""
    w = weight if weight is not None else np.random.default_rng(0).standard_normal((64, 8, 5, 5)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[2, 2, 2, 2]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return _model(nodes, [_vi("x", [1, 8, 16, 16])], [_vi("y", [1, 64, 16, 16])],
                  [numpy_helper.from_array(w, "w")])


def _relu(inputs: Sequence[onnx.ValueInfoProto] = (), **kwargs) -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"], name="relu")], list(inputs) or [_vi("x", [1, 4])],
                  [_vi("y", [1, 4])], **kwargs)


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.write_bytes(model.SerializeToString())


def _external(folder: Path, location: str) -> None:
    """model.onnx whose weight lives in external data at `location`, set by hand as an attacker would."""
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    tensor = numpy_helper.from_array(w, "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(w.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")], [_vi("x", [1, 4])],
                   [_vi("y", [1, 4])], [tensor])
    _save(model, folder / "model.onnx")


def _outside_secret(folder: Path) -> Path:
    """A 64-byte file outside the case folder, standing in for /etc/passwd or an SSH key."""
    secret = folder.parent / f"{folder.name}-outside" / "secret.bin"
    secret.parent.mkdir(exist_ok=True)
    secret.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    return secret


def _if_with_det() -> onnx.ModelProto:
    """An If whose then-branch holds a Det (no converter): the unsupported op hides in a subgraph."""
    then = helper.make_graph([helper.make_node("Det", ["x"], ["d"], name="inner_det")],
                             "then", [], [_vi("d", [2])])
    other = helper.make_graph([helper.make_node("Constant", [], ["zeros"], name="zeros",
                                                value=numpy_helper.from_array(np.zeros(2, np.float32)))],
                              "else", [], [_vi("zeros", [2])])
    node = helper.make_node("If", ["cond"], ["d"], name="branch", then_branch=then, else_branch=other)
    return _model([node], [_vi("cond", [], TensorProto.BOOL), _vi("x", [2, 3, 3])], [_vi("d", [2])])


def _frontend_failure() -> onnx.ModelProto:
    """Valid for onnx.checker and ONNX Runtime, but TVM's frontend takes TopK's k only as a constant. k is
    an input, so constant folding cannot hide the op."""
    nodes = [helper.make_node("TopK", ["x", "k"], ["values", "indices"], name="topk", axis=1)]
    return _model(nodes, [_vi("x", [4, 64]), _vi("k", [1], TensorProto.INT64)],   # wider than a drawn k
                  [_vi("values", [4, "k"]), _vi("indices", [4, "k"], TensorProto.INT64)])


def _wide_conv() -> onnx.ModelProto:
    """A 3 -> 256 channel conv: a large image fits as input, but not as the conv's output."""
    w = numpy_helper.from_array(np.zeros((256, 3, 1, 1), np.float32), "w")
    return _model([helper.make_node("Conv", ["image", "w"], ["features"], name="widen")],
                  [_vi("image", [1, 3, "h", "w"])], [_vi("features", [1, 256, "h", "w"])], [w])


def _npz(folder: Path, **arrays: np.ndarray) -> None:
    np.savez(folder / "inputs.npz", **arrays)


# ----------------------------------------------------------------------------- the corpus

Builder = Callable[[Path], None]

CASES: list[tuple[BadCase, Builder]] = [
    (BadCase("empty", "empty file", "model.onnx", expect=("model.onnx", "empty file")),
     lambda d: (d / "model.onnx").write_bytes(b"")),
    (BadCase("truncated", "truncated file (first half of a valid model)", "model.onnx",
             expect=("model.onnx", "truncated or corrupt")),
     lambda d: (d / "model.onnx").write_bytes((b := conv_model().SerializeToString())[: len(b) // 2])),
    (BadCase("png", "a PNG image renamed .onnx", "image.onnx", expect=("image.onnx", "a PNG image")),
     lambda d: (d / "image.onnx").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10\x00\x00\x00\x10"
                                              b"\x08\x02\x00\x00\x00\x90\x91h6" + bytes(64))),
    (BadCase("text", "a text file", "notes.onnx", expect=("notes.onnx", "not an ONNX model", "text file")),
     lambda d: (d / "notes.onnx").write_text("These are my notes, not a model.\nSecond line.\n")),
    (BadCase("random", "random bytes", "random.onnx", expect=("random.onnx", "not an ONNX model (4096 bytes")),
     lambda d: (d / "random.onnx").write_bytes(np.random.default_rng(7).bytes(4096))),
    (BadCase("opset99", "default-domain opset 99", "model.onnx", expect=("model.onnx", "opset 99")),
     lambda d: _save(_relu(opsets=(("", 99),)), d / "model.onnx")),
    (BadCase("ir99", "IR version 99", "model.onnx", expect=("model.onnx", "IR version 99")),
     lambda d: _save(_relu(ir_version=99), d / "model.onnx")),
    (BadCase("det", "unsupported operator (Det)", "model.onnx",
             expect=("model.onnx", "unsupported operator Det", "node 'det'")),
     lambda d: _save(_model([helper.make_node("Det", ["x"], ["d"], name="det")],
                            [_vi("x", [2, 3, 3])], [_vi("d", [2])]), d / "model.onnx")),
    (BadCase("det-in-if", "unsupported operator inside an If branch", "model.onnx",
             expect=("model.onnx", "unsupported operator Det", "inner_det", "branch")),
     lambda d: _save(_if_with_det(), d / "model.onnx")),
    (BadCase("custom-op", "made-up operator in a custom domain", "model.onnx",
             expect=("model.onnx", "com.example::Frobnicate", "node 'frob'")),
     lambda d: _save(_model([helper.make_node("Frobnicate", ["x"], ["y"], name="frob", domain="com.example")],
                            [_vi("x", [1, 4])], [_vi("y", [1, 4])], opsets=(("", OPSET), ("com.example", 1))),
                     d / "model.onnx")),
    (BadCase("unknown-op", "made-up operator in the default domain", "model.onnx",
             expect=("model.onnx", "Frobnicate", "frob")),
     lambda d: _save(_model([helper.make_node("Frobnicate", ["x"], ["y"], name="frob")],
                            [_vi("x", [1, 4])], [_vi("y", [1, 4])]), d / "model.onnx")),
    (BadCase("frontend", "checker-valid model TVM's frontend rejects (TopK with a run-time k)", "model.onnx",
             expect=("model.onnx", "node 'topk'", "TopK", "constant")),
     lambda d: _save(_frontend_failure(), d / "model.onnx")),
    (BadCase("ext-dotdot", "external data location with '..'", "model.onnx",
             expect=("model.onnx", "'w'", "../", "outside the model folder")),
     lambda d: (_outside_secret(d), _external(d, f"../{d.name}-outside/secret.bin"))),
    (BadCase("ext-absolute", "external data at an absolute path", "model.onnx",
             expect=("model.onnx", "'w'", "absolute path")),
     lambda d: _external(d, str(_outside_secret(d)))),
    (BadCase("ext-symlink", "external data through a symlink leading out of the folder", "model.onnx",
             expect=("model.onnx", "'w'", "weights.bin", "symbolic link")),
     lambda d: (os.symlink(_outside_secret(d), d / "weights.bin"), _external(d, "weights.bin"))),
    (BadCase("ext-symlink-dir", "external data in a symlinked sub-folder", "model.onnx",
             expect=("model.onnx", "'w'", "data/secret.bin", "symbolic link")),
     lambda d: (os.symlink(_outside_secret(d).parent, d / "data"), _external(d, "data/secret.bin"))),
    (BadCase("ext-missing", "external data file missing", "model.onnx",
             expect=("model.onnx", "'w'", "weights.bin", "not found")),
     lambda d: _external(d, "weights.bin")),
    (BadCase("ext-short", "external data file shorter than its length", "model.onnx",
             expect=("model.onnx", "'w'", "past the end")),
     lambda d: ((d / "weights.bin").write_bytes(b"\0" * 8), _external(d, "weights.bin"))),
    (BadCase("nan-weights", "NaN and Inf in weights (still verified)", "nan_weights.onnx",
             expect=("nan_weights.onnx", "'w'", "NaN", "Inf"), exit_codes=(0, 1), warning=True),
     lambda d: _save(conv_model(np.where(np.arange(64 * 8 * 25).reshape(64, 8, 5, 5) % 97 == 0,
                                         np.float32(np.nan),
                                         np.where(np.arange(64 * 8 * 25).reshape(64, 8, 5, 5) == 5,
                                                  np.float32(np.inf), np.float32(0.01))).astype(np.float32)),
                     d / "nan_weights.onnx")),
    (BadCase("zero-dim", "input declared with a 0 dimension", "model.onnx",
             expect=("model.onnx", "'x'", "zero-size", "[0, 4]")),
     lambda d: _save(_relu([_vi("x", [0, 4])]), d / "model.onnx")),
    (BadCase("huge-shape", "--shape x=100000x100000x3x3 (360 GB)", "model.onnx",
             args=("--shape", "x=100000x100000x3x3"), expect=("model.onnx", "'x'", "335.3 GiB", "limit")),
     lambda d: _save(_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [_vi("x", ["n", "m", 3, 3])],
                            [_vi("y", ["n", "m", 3, 3])]), d / "model.onnx")),
    (BadCase("huge-activation", "an image that fits, but whose conv output does not", "model.onnx",
             args=("--shape", "image=1x3x8192x8192"),
             expect=("model.onnx", "'features'", "node 'widen'", "64.0 GiB", "limit")),
     lambda d: _save(_wide_conv(), d / "model.onnx")),
    (BadCase("shape-unknown", "--shape naming no input", "model.onnx", args=("--shape", "image=1x4"),
             expect=("model.onnx", "'image'", "not an input", "x")),
     lambda d: _save(_relu([_vi("x", ["batch", 4])]), d / "model.onnx")),
    (BadCase("shape-rank", "--shape of the wrong rank", "model.onnx", args=("--shape", "x=1x4x4"),
             expect=("model.onnx", "x=1x4x4", "rank 3", "rank 2")),
     lambda d: _save(_relu([_vi("x", ["batch", 4])]), d / "model.onnx")),
    (BadCase("shape-conflict", "--shape conflicting with a fixed dim", "model.onnx", args=("--shape", "x=2x5"),
             expect=("model.onnx", "x", "dimension 1", "fixed to 4", "got 5")),
     lambda d: _save(_relu([_vi("x", ["batch", 4])]), d / "model.onnx")),
    (BadCase("shape-syntax", "--shape without dims", "model.onnx", args=("--shape", "x"),
             expect=("--shape", "'x'", "NAME=")),
     lambda d: _save(_relu(), d / "model.onnx")),
    (BadCase("npz-missing", "--inputs FILE.npz missing an input: drawn at random, as --help says", "model.onnx",
             args=("--inputs", "{dir}/inputs.npz"), exit_codes=(0,)),
     lambda d: (_save(_model([helper.make_node("Add", ["a", "b"], ["y"], name="add")],
                             [_vi("a", [2, 3]), _vi("b", [2, 3])], [_vi("y", [2, 3])]), d / "model.onnx"),
                _npz(d, a=np.ones((2, 3), np.float32)))),
    (BadCase("npz-extra", "--inputs FILE.npz with an extra array", "model.onnx",
             args=("--inputs", "{dir}/inputs.npz"), expect=("'bias'", "unknown input", "x")),
     lambda d: (_save(_relu(), d / "model.onnx"),
                _npz(d, x=np.ones((1, 4), np.float32), bias=np.ones((1, 4), np.float32)))),
    (BadCase("npz-shape", "--inputs FILE.npz array of the wrong shape", "model.onnx",
             args=("--inputs", "{dir}/inputs.npz"), expect=("'x'", "expected shape (1, 4)", "(3, 3)")),
     lambda d: (_save(_relu(), d / "model.onnx"), _npz(d, x=np.ones((3, 3), np.float32)))),
    (BadCase("dup-node-output", "two nodes producing the same tensor", "model.onnx",
             expect=("model.onnx", "'y'")),
     lambda d: _save(_model([helper.make_node("Relu", ["x"], ["y"], name="first"),
                             helper.make_node("Neg", ["x"], ["y"], name="second")],
                            [_vi("x", [1, 4])], [_vi("y", [1, 4])]), d / "model.onnx")),
    (BadCase("dup-init-output", "an initializer and a node output with one name", "model.onnx",
             expect=("model.onnx", "'w'")),
     lambda d: _save(_model([helper.make_node("Relu", ["x"], ["w"], name="relu"),
                             helper.make_node("Add", ["w", "x"], ["y"], name="add")],
                            [_vi("x", [1, 4])], [_vi("y", [1, 4])],
                            [numpy_helper.from_array(np.ones((1, 4), np.float32), "w")]), d / "model.onnx")),
    (BadCase("no-file", "a path that does not exist", "missing.onnx", expect=("missing.onnx", "no such file")),
     lambda d: None),
    (BadCase("directory", "a directory named like a model", "folder.onnx", expect=("folder.onnx", "directory")),
     lambda d: (d / "folder.onnx").mkdir()),
    (BadCase("string-input", "an input of element type STRING", "strings.onnx",
             expect=("strings.onnx", "'x'", "STRING")),
     lambda d: _save(_model([helper.make_node("Identity", ["x"], ["y"], name="same")],
                            [_vi("x", [2], TensorProto.STRING)], [_vi("y", [2], TensorProto.STRING)]),
                     d / "strings.onnx")),
]


def build_corpus(root: Path) -> list[tuple[BadCase, Path]]:
    """Write every case into `root/<name>/`; return (case, folder) pairs."""
    out = []
    for case, builder in CASES:
        folder = root / case.name
        folder.mkdir(parents=True, exist_ok=True)
        builder(folder)
        out.append((case, folder))
    return out


def cli_argv(case: BadCase, folder: Path) -> list[str]:
    args = [a.replace("{dir}", str(folder)) for a in case.args]
    return [sys.executable, "-m", "fuseguard.verify.cli", "verify", str(folder / case.model), "--no-schedule", *args]


def run_cli(case: BadCase, folder: Path, timeout: float = 300.0) -> CliResult:
    argv = cli_argv(case, folder)
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return CliResult(case, folder, proc.returncode, proc.stdout, proc.stderr, argv)


def run_all(root: Path, jobs: int = 4) -> list[CliResult]:
    """Run the CLI on every case, `jobs` at a time: each run is mostly start-up (importing TVM)."""
    corpus = build_corpus(root)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda pair: run_cli(*pair), corpus))


DOC_ROOT = "/tmp/corpus"  # the temp folder, as the docs show it
TABLE_START, TABLE_END = "<!-- table:start -->", "<!-- table:end -->"


def markdown_table(results: Sequence[CliResult], root: Path) -> str:
    """The docs table: each input, its command, exit code and exact stderr, with the temp folder renamed."""
    rows = ["| input | command | exit | stderr |", "| --- | --- | --- | --- |"]
    for r in results:
        args = " ".join(r.argv[4:]).replace(str(root), DOC_ROOT)
        text = "<br>".join(f"`{line}`" for line in r.lines).replace(str(root), DOC_ROOT).replace("|", "\\|")
        rows.append(f"| {r.case.what} | `fuseguard verify {args}` | {r.returncode} | {text or '(nothing)'} |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the docs/bad-inputs.md table from a fresh corpus and the real CLI, or with
    `--write FILE` replace the table between the markers in FILE."""
    args = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="fuseguard-bad-") as tmp:
        table = markdown_table(run_all(Path(tmp)), Path(tmp))
    if args[:1] == ["--write"] and len(args) == 2:
        doc = Path(args[1])
        text = doc.read_text()
        head, rest = text.split(TABLE_START, 1)
        _, tail = rest.split(TABLE_END, 1)
        doc.write_text(f"{head}{TABLE_START}\n{table}{TABLE_END}{tail}")
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
