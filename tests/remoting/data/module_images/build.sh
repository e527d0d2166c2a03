#!/bin/sh
# Rebuild the committed images (nvcc 13.0 made them).
set -eu
cd "$(dirname "$0")"
nvcc -arch=sm_90 -cubin -o globals.sm_90.cubin globals.cu
nvcc -arch=sm_90 -ptx -o globals.ptx globals.cu
nvcc -arch=sm_90 -fatbin --compress-mode=none -o globals.plain.fatbin globals.cu
nvcc -arch=sm_90 -fatbin --compress-mode=speed -Xfatbin -compress-all -o globals.lz4.fatbin globals.cu
nvcc -arch=sm_90 -fatbin --compress-mode=default -Xfatbin -compress-all -o globals.zstd.fatbin globals.cu
nvcc -gencode arch=compute_90,code=compute_90 -fatbin -o globals.ptx-only.fatbin globals.cu
nvcc -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -fatbin --compress-mode=none \
     -o globals.sm_80-sm_90.fatbin globals.cu
nvcc -arch=sm_90 -cubin -o local_memory.sm_90.cubin local_memory.cu
