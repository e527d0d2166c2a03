"""Build the cuda-samples that rgpu is checked against (benchmarks/cuda_samples/SAMPLES.txt).

    python benchmarks/cuda_samples/build.py --source CUDA_SAMPLES_CHECKOUT --out DIR \\
        [--arch sm_90] [--cuda-libs DIR] [--rpath DIR] [--samples a,b] [--jobs N]

Each sample becomes <out>/<name>/<name>, with the files it opens at run time beside it (kernel
fatbins and PTX, NVRTC kernel sources and headers, data files); <out>/LIST names the samples that
built, <out>/BUILD.json records how. No GPU is needed, only nvcc (CUDA 12.x or 13.x).

- Samples without a CUDA math library link cudart statically; those with one (cuBLAS, cuFFT,
  cuRAND, cuSOLVER, cuSPARSE) link it shared, and <out>/cudart/ gets the toolkit's libcudart;
  NVRTC samples use the driver API only. --cudart shared makes every sample share it (smaller).
- --cuda-libs names a folder with include/ and lib/ of the math libraries, e.g. the unpacked
  nvidia-cublas / -cufft / -curand / -cusolver / -cusparse / -cuda-nvrtc / -nvjitlink wheels
  (<wheels>/nvidia/cu13). The toolkit's own folder is used when it has them.
- --rpath is written into each binary: where the math libraries are on the GPU machine
  (e.g. /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib).
- nvJitLink.h is pinned to the --nvjitlink-abi entry points (default 13_0) so that jitLto runs
  with the libnvJitLink of any CUDA 13 driver generation.
A sample that fails to build is reported and left out of LIST; the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.cuda_samples.plan import (  # noqa: E402
    PlanError,
    SamplePlan,
    Toolchain,
    compile_command,
    gencode,
    image_command,
    link_name,
    parse_sample_list,
    pin_nvjitlink,
    plan_sample,
    select,
)

SAMPLES_TXT = HERE / "SAMPLES.txt"
NVRTC_HEADERS = HERE / "matrixMul_nvrtc_headers.txt"   # the toolkit headers matrixMul_nvrtc's NVRTC opens


class BuildError(Exception):
    """A setup problem that stops the whole build (one line)."""


@dataclass(frozen=True)
class Outcome:
    rel: str
    ok: bool
    seconds: float
    message: str = ""


# ------------------------------------------------------------------------------ the build machine

def find_nvcc(cuda_home: Path) -> str:
    for candidate in (cuda_home / "bin" / "nvcc", shutil.which("nvcc")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise BuildError(f"build: no nvcc in {cuda_home}/bin or on PATH (install the CUDA toolkit, or pass --cuda-home)")


def find_libcuda(cuda_home: Path) -> Path:
    """A libcuda to link against: the toolkit's stub, else rgpu's own libcuda (same soname,
    libcuda.so.1: at run time the loader picks the machine's driver, or rgpu's)."""
    for stub in (cuda_home / "lib64" / "stubs" / "libcuda.so", *sorted(cuda_home.glob("targets/*/lib/stubs/libcuda.so"))):
        if stub.is_file():
            return stub
    try:
        from rgpu.remoting.native.build import ensure_built
        return ensure_built().libcuda
    except Exception as e:   # noqa: BLE001 - any failure means: no libcuda to link with
        raise BuildError(f"build: no libcuda stub under {cuda_home} and rgpu's libcuda could not be built ({e}); "
                         "pass --cuda-home of a full CUDA toolkit") from e


def math_library_dir(cuda_libs: Path | None, cuda_home: Path) -> Path | None:
    """The folder with include/ and lib/ of the math libraries: --cuda-libs, else the toolkit's when it has cuBLAS."""
    if cuda_libs:
        if not (cuda_libs / "include").is_dir() or not (cuda_libs / "lib").is_dir():
            raise BuildError(f"build: --cuda-libs {cuda_libs} has no include/ and lib/ folders "
                             "(name e.g. <unpacked wheels>/nvidia/cu13)")
        return cuda_libs
    return cuda_home if list((cuda_home / "lib64").glob("libcublas.so*")) else None


def prepare_link_dir(link_dir: Path, libcuda: Path, libs: Path | None, abi: str) -> Path | None:
    """Fill `link_dir` with libcuda.so and unversioned names of the math libraries; return a
    folder with the pinned nvJitLink.h, if the libraries have one."""
    (link_dir / "libcuda.so").symlink_to(libcuda.resolve())
    if libs is None:
        return None
    lib_dir = libs / "lib" if (libs / "lib").is_dir() else libs / "lib64"
    for path in sorted(lib_dir.iterdir()):
        name = link_name(path.name)
        if name and not (link_dir / name).exists():
            (link_dir / name).symlink_to(path.resolve())
    header = libs / "include" / "nvJitLink.h"
    if not header.is_file():
        return None
    include = link_dir / "include"
    include.mkdir()
    (include / "nvJitLink.h").write_text(pin_nvjitlink(header.read_text(), abi))
    return include


def sample_files(folder: Path) -> frozenset[str]:
    return frozenset(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def load_plan(source: Path, rel: str, cudart: str | None) -> SamplePlan:
    folder = source / "Samples" / rel
    cmake = folder / "CMakeLists.txt"
    if not cmake.is_file():
        raise PlanError(f"{rel}: no {cmake} (is --source a cuda-samples checkout of a revision that has it?)")
    files = sample_files(folder)
    text = "".join((folder / f).read_text(errors="replace") for f in sorted(files)
                   if f.endswith((".c", ".cpp", ".cu", ".h", ".cuh")))
    return plan_sample(rel, cmake.read_text(errors="replace"), files, text, cudart)


# ------------------------------------------------------------------------------ one sample

def _run(cmd: list[str]) -> str | None:
    """None on success, else the compiler's last error lines."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [f"exit {done.returncode}"])[0].strip()


def copy_beside(plan: SamplePlan, sample_dir: Path, out_dir: Path, cuda_include: Path) -> None:
    """The files the CMake POST_BUILD steps copy beside the binary."""
    for rel in plan.data:
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(sample_dir / rel, out_dir / rel)
    for name in plan.cuda_include_files:
        if (cuda_include / name).is_file():
            shutil.copy(cuda_include / name, out_dir / name)
    if plan.copies_include_dirs:
        for header in NVRTC_HEADERS.read_text().split():
            src = cuda_include / header
            if not src.is_file():
                src = cuda_include / "cccl" / header
            (out_dir / header).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, out_dir / header)


def build_one(plan: SamplePlan, tc: Toolchain, source: Path, out: Path, cuda_include: Path) -> Outcome:
    started = time.monotonic()
    sample_dir, out_dir = source / "Samples" / plan.rel, out / plan.name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    for image in plan.images:
        error = _run(image_command(image, tc, sample_dir, out_dir))
        if error:
            return Outcome(plan.rel, False, time.monotonic() - started, f"kernel {image.source}: {error}")
    error = _run(compile_command(plan, tc, sample_dir, out_dir / plan.name))
    if error:
        shutil.rmtree(out_dir, ignore_errors=True)
        return Outcome(plan.rel, False, time.monotonic() - started, error)
    if shutil.which("strip"):
        subprocess.run(["strip", str(out_dir / plan.name)], check=False)
    try:
        copy_beside(plan, sample_dir, out_dir, cuda_include)
    except OSError as e:
        return Outcome(plan.rel, False, time.monotonic() - started, f"copying its files: {e}")
    return Outcome(plan.rel, True, time.monotonic() - started)


# ------------------------------------------------------------------------------ the whole list

def copy_cudart(cuda_home: Path, out: Path) -> None:
    found = sorted((cuda_home / "lib64").glob("libcudart.so.[0-9]*"), key=lambda p: len(p.name))
    if not found:
        raise BuildError(f"build: no libcudart.so.N in {cuda_home}/lib64 for the shared-cudart samples")
    (out / "cudart").mkdir(exist_ok=True)
    shutil.copy(found[0].resolve(), out / "cudart" / found[0].name)


def build_all(plans: list[SamplePlan], tc: Toolchain, source: Path, out: Path, cuda_include: Path,
              jobs: int) -> list[Outcome]:
    outcomes: dict[str, Outcome] = {}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = {pool.submit(build_one, p, tc, source, out, cuda_include): p for p in plans}
        for done, future in enumerate(as_completed(futures), 1):
            result = future.result()
            outcomes[result.rel] = result
            verdict = "ok" if result.ok else f"FAILED: {result.message}"
            print(f"[{done}/{len(plans)}] {result.rel}: {verdict} ({result.seconds:.1f} s)", flush=True)
    return [outcomes[p.rel] for p in plans]


def plans_for(entries: Iterable[str], source: Path, cudart: str | None, needs_libs: bool) -> tuple[list[SamplePlan], list[Outcome]]:
    plans, refused = [], []
    for rel in entries:
        try:
            plan = load_plan(source, rel, cudart)
        except PlanError as e:
            refused.append(Outcome(rel, False, 0.0, str(e).removeprefix(f"{rel}: ")))
            continue
        if plan.libraries and not needs_libs:
            refused.append(Outcome(rel, False, 0.0, f"links {', '.join(plan.libraries)}, and neither --cuda-libs "
                                                    "nor the toolkit has them (pass --cuda-libs DIR)"))
            continue
        plans.append(plan)
    return plans, refused


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, required=True, help="a checkout of github.com/NVIDIA/cuda-samples")
    p.add_argument("--out", type=Path, required=True, help="output folder (<out>/<name>/<name>, <out>/LIST)")
    p.add_argument("--arch", default="sm_90", help="GPU architecture to compile for (default sm_90: H100/H200)")
    p.add_argument("--cuda-libs", type=Path, help="folder with include/ and lib/ of cuBLAS, cuFFT, ... (unpacked wheels)")
    p.add_argument("--rpath", help="run-time search path for the math libraries, written into the binaries")
    p.add_argument("--cuda-home", type=Path, default=Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")),
                   help="the CUDA toolkit (default $CUDA_HOME or /usr/local/cuda)")
    p.add_argument("--cudart", choices=("auto", "shared"), default="auto",
                   help="auto: static without a math library, shared with one; shared: every sample")
    p.add_argument("--nvjitlink-abi", default="13_0", help="nvJitLink entry-point version to link (default 13_0)")
    p.add_argument("--list", type=Path, default=SAMPLES_TXT, help="the sample list (default: SAMPLES.txt beside this file)")
    p.add_argument("--samples", help="comma-separated names: build only these of the list")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except (BuildError, PlanError) as e:
        print(str(e) if str(e).startswith("build:") else f"build: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if not (args.source / "Samples").is_dir() or not (args.source / "Common").is_dir():
        raise BuildError(f"build: --source {args.source} is not a cuda-samples checkout (no Samples/ and Common/ in it)")
    if not args.list.is_file():
        raise BuildError(f"build: no sample list {args.list}")
    gencode(args.arch)
    entries = parse_sample_list(args.list.read_text())
    if args.samples:
        entries = select(entries, [n.strip() for n in args.samples.split(",") if n.strip()])
    nvcc = find_nvcc(args.cuda_home)
    libs = math_library_dir(args.cuda_libs, args.cuda_home)
    plans, refused = plans_for(entries, args.source, None if args.cudart == "auto" else args.cudart, libs is not None)
    for r in refused:
        print(f"skipped {r.rel}: {r.message}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rgpu-cs-link-") as tmp:
        include = prepare_link_dir(Path(tmp), find_libcuda(args.cuda_home), libs, args.nvjitlink_abi)
        tc = Toolchain(nvcc=nvcc, common_include=args.source / "Common", arch=args.arch, link_dir=Path(tmp),
                       cuda_libs=libs, extra_include=include, rpath=args.rpath)
        if any(p.cudart == "shared" for p in plans):
            copy_cudart(args.cuda_home, args.out)
        outcomes = build_all(plans, tc, args.source, args.out, args.cuda_home / "include", args.jobs)
    built = [o.rel for o in outcomes if o.ok]
    (args.out / "LIST").write_text("".join(rel.rsplit("/", 1)[-1] + "\n" for rel in built))
    record = {"arch": args.arch, "rpath": args.rpath, "nvcc": nvcc, "source": str(args.source),
              "cudart": {p.name: p.cudart for p in plans if p.rel in built}}
    (args.out / "BUILD.json").write_text(json.dumps(record, indent=2) + "\n")
    failed = [o for o in outcomes if not o.ok] + refused
    print(f"built {len(built)} of {len(entries)} into {args.out} (LIST written)")
    for o in failed:
        print(f"  not built: {o.rel}: {o.message}")
    return 0 if built else 1


if __name__ == "__main__":
    raise SystemExit(main())
