# Source this on the GPU machine from the checkout's root (benchmarks/gpu_kit/README.md): installs
# rgpu from the checkout and the wheels in .whl/ into /tmp/site (once per machine), and puts UCX from
# .devbuild/ucx/ on the paths rgpu and copies.py look at. Returns non-zero, saying why, on failure.
export PYTHONUNBUFFERED=1
# Keep NVLink multicast off on lent multi-GPU machines (their page says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -e /tmp/site/.rgpu-installed ]; then
  gpukit_t0=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rgpu-build-tools \
    .whl/build/*.whl || { echo "gpu_kit: the build tools in .whl/build/ did not install (carry .whl; run" \
                               "benchmarks/gpu_kit/prepare.sh)" >&2; return 1; }
  # One pip run for the wheels and rgpu: a second one into the same --target would leave its bin/ out.
  PYTHONPATH=/tmp/rgpu-build-tools python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl . > /tmp/rgpu-install.log 2>&1 \
    || { tail -20 /tmp/rgpu-install.log >&2; echo "gpu_kit: rgpu and its wheels did not install (above)" >&2; return 1; }
  touch /tmp/site/.rgpu-installed
  echo "gpu_kit: installed into /tmp/site in $(( $(date +%s) - gpukit_t0 )) s"
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PWD/.devbuild/ucx/libucx/bin:$PATH
if [ -d .devbuild/ucx/libucx/lib ]; then
  export RGPU_UCX_LIB=$PWD/.devbuild/ucx/libucx/lib
  export LD_LIBRARY_PATH=$PWD/.devbuild/ucx/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}   # ucx_perftest's
fi
