#!/bin/sh
# Build the PTX, cubin and fatbin images of vecadd.cu (run where nvcc is; the outputs are
# committed so that CPU-only CI and the GPU machine need no compiler for them).
set -e
cd "$(dirname "$0")"
nvcc -ptx -arch=compute_90 -o vecadd.ptx vecadd.cu
nvcc -cubin -arch=sm_90 -o vecadd.sm_90.cubin vecadd.cu
nvcc -fatbin -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 -o vecadd.fatbin vecadd.cu
