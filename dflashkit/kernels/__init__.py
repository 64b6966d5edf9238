"""Compute kernels: CPU row kernels (C++ in csrc/), prepacked and int8 linears, attention, CUDA-graph capture."""
