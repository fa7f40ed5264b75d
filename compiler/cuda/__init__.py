"""CUDA targets: legalisations for dlight (legalize), SASS from nvcc/ptxas (sass), occupancy and the
register-aware GPU cost model (occupancy, cost), and running the kernels where a GPU is (jit)."""
