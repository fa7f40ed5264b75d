"""Graph passes over Relax, steps 0b-4c and 9b of the pipeline: normalising (normalize), int8 QDQ (qdq,
int8_gemm), reduced precision, channel padding and the blocked layout, the legalisations where TVM differs
from ONNX (legalize_fixes), and the in-place concat after memory planning (concat_in_place)."""
