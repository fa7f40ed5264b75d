"""`fuseguard bisect`: find the fused group (or the lowered operator) where a model's output drifts.

Polygraphy's ``--mark all`` turns every tensor into a graph output, and so takes apart the very
fusions under suspicion. Here both builds are compiled exactly as shipped and only *probed*:
`compiler.capture.CapturePass` makes Relax ``main`` also return every kernel's output, after
FuseOps/FuseTIR and without touching a kernel. One fused kernel is one fused group, one unfused
kernel is one operator, and `compiler.capture.align` maps each fused group's output onto the
unfused tensor that holds the same value (provenance names, then structure).

Then, in execution order:

* **fusion** (fused != unfused while unfused == ONNX Runtime): the first fused kernel whose output
  leaves tolerance while its inputs still agree is the culprit group;
* **import/lowering** (unfused != ONNX Runtime): unfused intermediates are compared with ONNX
  Runtime's values for the ONNX tensors they stand for (ORT runs with graph optimisations off and
  the intermediates exposed as graph outputs); where no tensor maps, the ONNX graph is bisected in
  node order with prefix sub-models cut by `onnx.utils.Extractor` (log2 N builds).

The culprit is written out as a minimal reproducer: the ONNX sub-model from the culprit's input
tensors to its output tensor, plus the input values it actually saw (``repro.npz``), so that
``fuseguard verify repro.onnx --inputs repro.npz`` reproduces it on its own. A *fusion* bug only
reproduces where the same bad fusion is built: load the same ``--plugin`` (or pass the same
``extra_passes``) when verifying the reproducer.

Exit codes follow ``git bisect run``: 0 no drift, 1 drift found, 125 the model cannot be built
(or run) at this commit, so the commit is skipped; 2 is a usage error.
"""

from .cli import add_bisect_parser, run_bisect
from .results import (BLAME_FUSION, BLAME_LOWERING, EXIT_DRIFT, EXIT_NO_DRIFT, EXIT_UNTESTABLE, EXIT_USAGE,
                      BisectResult, Culprit, Reproducer)
from .search import bisect_model

__all__ = ["BLAME_FUSION", "BLAME_LOWERING", "EXIT_DRIFT", "EXIT_NO_DRIFT", "EXIT_UNTESTABLE", "EXIT_USAGE",
           "BisectResult", "Culprit", "Reproducer", "add_bisect_parser", "bisect_model", "run_bisect"]
