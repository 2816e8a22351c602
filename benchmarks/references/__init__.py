"""Triton kernels of our own, written after the designs of Triton's public tutorials, that
tiledsl's generated kernels are compared with (`benchmarks/static_sm90.py` reads both from
their sm_90 builds; on a GPU they are baselines to time). Each module runs its kernels on
torch tensors (CUDA tensors compiled, CPU tensors through Triton's interpreter) and lists
its sm_90 builds at the benchmark shapes (`sm90_builds`)."""
