# Source this on the GPU machine from the checkout's root (benchmarks/gpu_kit/README.md): installs
# rgpu from the checkout and the wheels in .whl/ into /tmp/site (once per machine), and puts UCX from
# .devbuild/ucx/ on the paths rgpu and copies.py look at. Returns non-zero, saying why, on failure.
export PYTHONUNBUFFERED=1
# Keep NVLink multicast off on lent multi-GPU machines (their page says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -e /tmp/site/.rgpu-installed ]; then
  gpukit_t0=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_kit: the wheels in .whl/ did not install (carry .whl; run benchmarks/gpu_kit/prepare.sh)" >&2; return 1; }
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target /tmp/site . > /tmp/rgpu-install.log 2>&1 \
    || { tail -20 /tmp/rgpu-install.log >&2; echo "gpu_kit: rgpu did not install from the checkout (above)" >&2; return 1; }
  touch /tmp/site/.rgpu-installed
  echo "gpu_kit: installed into /tmp/site in $(( $(date +%s) - gpukit_t0 )) s"
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PWD/.devbuild/ucx/libucx/bin:$PATH
if [ -d .devbuild/ucx/libucx/lib ]; then
  export RGPU_UCX_LIB=$PWD/.devbuild/ucx/libucx/lib
  export LD_LIBRARY_PATH=$PWD/.devbuild/ucx/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}   # ucx_perftest's
fi
