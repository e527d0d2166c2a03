#!/usr/bin/env bash
# Prepare, on a machine with PyPI, what a GPU machine without any network needs to run rgpu's GPU tests
# and benchmarks from this checkout (benchmarks/gpu_kit/README.md): wheels of rgpu's runtime
# dependencies for the GPU machine's Python into .whl/, and UCX's libraries and tools (from the
# libucx-cu13 wheel) into .devbuild/ucx/. Both folders are ignored by git; carry them to the GPU
# machine beside the checkout and source benchmarks/gpu_kit/setup.sh there.
#   benchmarks/gpu_kit/prepare.sh [--python-version 3.12]
set -euo pipefail
cd "$(dirname "$0")/../.."
pyver=3.12
if [ "${1:-}" = "--python-version" ] && [ -n "${2:-}" ]; then pyver=$2; fi
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64)
download() { python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$pyver" \
               --implementation cp "${platforms[@]}" "$@"; }

# rgpu's runtime dependencies, resolved for that Python (the GPU image's own copies stay shadowed by
# these in /tmp/site there, so the versions are the ones pyproject.toml asks for).
rm -rf .whl && mkdir -p .whl
deps=$(python3 - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PY
)
mapfile -t wanted <<< "$deps"
echo "gpu_kit: downloading ${#wanted[@]} dependencies of rgpu and theirs for Python $pyver into .whl/ ..."
download -d .whl "${wanted[@]}"
# What building rgpu from the checkout there needs (pyproject.toml's build-system), kept apart: the
# GPU image's own setuptools may be older than it asks.
download -d .whl/build "setuptools>=69" wheel

# UCX (issue 25): the libucx-cu13 wheel's libraries, stripped, without its CUDA perftest plugin (10 MB).
tmp=$(mktemp -d -t rgpu-gpukit.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
echo "gpu_kit: downloading libucx-cu13 for .devbuild/ucx/ ..."
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "${platforms[@]}" \
  --python-version "$pyver" -d "$tmp" libucx-cu13
(cd "$tmp" && unzip -q libucx_cu13-*.whl)
out=.devbuild/ucx
rm -rf "$out" && mkdir -p "$out/libucx/lib/ucx" "$out/libucx/bin" "$out/libucx_cu13.libs"
for lib in libucp libuct libucs libucm libucs_signal; do
  cp -L "$tmp/libucx/lib/$lib.so.0" "$out/libucx/lib/" && ln -sf "$lib.so.0" "$out/libucx/lib/$lib.so"
done
for module in "$tmp"/libucx/lib/ucx/*.so.0; do
  case $module in *perftest*) continue ;; esac
  cp -L "$module" "$out/libucx/lib/ucx/" && ln -sf "$(basename "$module")" "$out/libucx/lib/ucx/$(basename "$module" .0)"
done
cp -L "$tmp/libucx/bin/ucx_info" "$tmp/libucx/bin/ucx_perftest" "$out/libucx/bin/"
cp "$tmp"/libucx_cu13.libs/* "$out/libucx_cu13.libs/"
strip --strip-unneeded "$out"/libucx/lib/*.so.0 "$out"/libucx/lib/ucx/*.so.0 "$out"/libucx/bin/* 2>/dev/null || true
echo "gpu_kit: .whl $(du -sh .whl | cut -f1), $out $(du -sh "$out" | cut -f1) (a device call carries 64 MiB at most)"
