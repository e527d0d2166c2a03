"""What to build for one cuda-sample, read from its CMakeLists.txt (pure: text in, plan out).

The samples' CMake files follow one pattern: `add_executable(name sources...)`, `CUDA::<lib>`
link targets, an optional kernel compiled to a fatbin or PTX file beside the binary, and
POST_BUILD copies of data files and (for NVRTC samples) kernel sources. This module turns that
into an nvcc command line and a list of files to copy, without running anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# CUDA math libraries a sample may link (CMake target -> -l name). CMake's CUDA::cusolver carries
# cuBLAS and cuSPARSE along, so a cuSOLVER sample links those too.
MATH_LIBRARIES = {"cublas": "cublas", "cufft": "cufft", "curand": "curand", "cusolver": "cusolver", "cusparse": "cusparse"}
KNOWN_TARGETS = frozenset(MATH_LIBRARIES) | {"nvrtc", "cuda_driver", "cudart"}
CUDART_MODES = ("static", "shared", "none")
_ARCH = re.compile(r"sm_(\d+[a-z]?)")


class PlanError(ValueError):
    """A sample this tool cannot build (the message is one line, naming the sample)."""


@dataclass(frozen=True)
class KernelImage:
    """A kernel the sample loads at run time, compiled separately (`-fatbin` or `-ptx`)."""
    source: str          # relative to the sample folder
    output: str          # file name beside the binary
    kind: str            # "fatbin" or "ptx"


@dataclass(frozen=True)
class SamplePlan:
    rel: str                          # category/name
    sources: tuple[str, ...]          # relative to the sample folder
    libraries: tuple[str, ...]        # -l names, in link order (without libcuda and cudart)
    cudart: str                       # static, shared or none (driver API only)
    rdc: bool                         # separable compilation
    extended_lambda: bool
    images: tuple[KernelImage, ...]
    data: tuple[str, ...]             # files copied beside the binary, relative to the sample folder
    cuda_include_files: tuple[str, ...]   # files copied from the toolkit's include folder
    copies_include_dirs: bool         # the CMake copies toolkit header folders (matrixMul_nvrtc)
    has_inc_dir: bool                 # the sample keeps headers in inc/

    @property
    def name(self) -> str:
        return self.rel.rsplit("/", 1)[-1]

    @property
    def uses_math_library(self) -> bool:
        return any(lib in MATH_LIBRARIES.values() for lib in self.libraries)


def parse_sample_list(text: str) -> list[str]:
    """`category/name` entries of SAMPLES.txt, in order: `#` starts a comment, blank lines are
    skipped. A malformed or repeated entry is a PlanError naming its line."""
    entries: list[str] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split("/")
        if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9_.-]+", p) for p in parts) or ".." in parts:
            raise PlanError(f"sample list line {number}: {line!r} is not `category/name` (e.g. 0_Introduction/vectorAdd)")
        name = parts[1]
        if name in seen:
            raise PlanError(f"sample list line {number}: {name} is listed twice")
        seen.add(name)
        entries.append(line)
    return entries


def select(entries: list[str], names: list[str]) -> list[str]:
    """The entries whose name (or category/name) is in `names`, in list order; an unknown name is a PlanError."""
    by_name = {e.rsplit("/", 1)[-1]: e for e in entries}
    unknown = [n for n in names if n not in by_name and n not in entries]
    if unknown:
        raise PlanError(f"not in the sample list: {', '.join(unknown)} (see benchmarks/cuda_samples/SAMPLES.txt)")
    wanted = {by_name.get(n, n) for n in names}
    return [e for e in entries if e in wanted]


def gencode(arch: str) -> list[str]:
    """nvcc flags for `sm_90`-style arch: SASS for it plus PTX for later GPUs."""
    m = _ARCH.fullmatch(arch)
    if not m:
        raise PlanError(f"--arch {arch!r} is not of the form sm_90")
    return ["-gencode", f"arch=compute_{m.group(1)},code=[sm_{m.group(1)},compute_{m.group(1)}]"]


def strip_comments(cmake: str) -> str:
    return re.sub(r"#[^\n]*", "", cmake)


def _sources(rel: str, cmake: str) -> tuple[str, ...]:
    found = re.findall(r"add_executable\(\s*\S+\s+([^)]*)\)", cmake)
    if len(found) != 1 or not found[0].split():
        raise PlanError(f"{rel}: expected one add_executable(...) with sources in its CMakeLists.txt, found {len(found)}")
    return tuple(found[0].split())


def _libraries(rel: str, cmake: str) -> tuple[str, ...]:
    libs: list[str] = []
    for target in re.findall(r"CUDA::(\w+)", cmake):
        if target not in KNOWN_TARGETS:
            raise PlanError(f"{rel}: links CUDA::{target}, which this tool does not know how to link")
        lib = MATH_LIBRARIES.get(target) or ("nvrtc" if target == "nvrtc" else None)
        if lib and lib not in libs:
            libs.append(lib)
    if "cusolver" in libs:
        libs += [lib for lib in ("cublas", "cusparse") if lib not in libs]
    if "NVJITLINK_LIB" in cmake:
        libs.append("nvJitLink")
    return tuple(libs)


def cudart_mode(libraries: tuple[str, ...], forced: str | None = None) -> str:
    """none for NVRTC samples (kernels compiled at run time, driver API only); shared for samples
    linking a CUDA math library (the libraries need it, and it keeps binaries small); static
    otherwise. `forced` ("static"/"shared") overrides the last two."""
    if "nvrtc" in libraries:
        return "none"
    if forced:
        return forced
    return "shared" if any(lib in MATH_LIBRARIES.values() for lib in libraries) else "static"


def _images(cmake: str, sources: tuple[str, ...], files: frozenset[str]) -> tuple[KernelImage, ...]:
    kernel = re.search(r'CUDA_KERNEL_SOURCE\s+"\$\{CMAKE_CURRENT_SOURCE_DIR\}/([^"]+)"', cmake)
    images = []
    for kind, var in (("fatbin", "CUDA_FATBIN_FILE"), ("ptx", "CUDA_PTX_FILE")):
        m = re.search(var + r'\s+"\$\{CMAKE_CURRENT_BINARY_DIR\}/([^"]+)"', cmake)
        if not m:
            continue
        if kernel:
            source = kernel.group(1)
        else:   # the one .cu file that is not part of the executable
            loose = sorted(f for f in files if f.endswith(".cu") and "/" not in f and f not in sources)
            if len(loose) != 1:
                continue
            source = loose[0]
        images.append(KernelImage(source=source, output=m.group(1), kind=kind))
    return tuple(images)


def _data(cmake: str, sources: tuple[str, ...], images: tuple[KernelImage, ...], files: frozenset[str],
          source_text: str) -> tuple[str, ...]:
    skip = set(sources) | {i.source for i in images}
    data: list[str] = []
    for ref in re.findall(r'\$\{CMAKE_CURRENT_SOURCE_DIR\}/([^\s")]+)', cmake):
        if ref not in files or ref in skip or ref in data:
            continue
        if ref.endswith(".mtx") and f'"{Path(ref).name}"' not in source_text:
            continue   # only the matrix the sample opens by default: the others are large
        data.append(ref)
    return tuple(data)


def plan_sample(rel: str, cmake: str, files: frozenset[str], source_text: str = "",
                forced_cudart: str | None = None) -> SamplePlan:
    """The build plan of sample `rel` from its CMakeLists.txt text; `files` are the paths of the
    sample folder's files (relative, with `/`), `source_text` its sources' text (to tell which data
    file it opens by default)."""
    cm = strip_comments(cmake)
    sources = _sources(rel, cm)
    missing = [s for s in sources if s not in files]
    if missing:
        raise PlanError(f"{rel}: the CMakeLists.txt names {', '.join(missing)}, which the sample folder lacks")
    libraries = _libraries(rel, cm)
    images = _images(cm, sources, files)
    return SamplePlan(
        rel=rel, sources=sources, libraries=libraries, cudart=cudart_mode(libraries, forced_cudart),
        rdc="CUDA_SEPARABLE_COMPILATION ON" in cm and any(s.endswith(".cu") for s in sources),
        extended_lambda="--extended-lambda" in cm, images=images,
        data=_data(cm, sources, images, files, source_text),
        cuda_include_files=tuple(re.findall(r"\$\{CUDA_INCLUDE_DIR\}/(\S+\.h)\b", cm)),
        copies_include_dirs="copy_directory" in cm and "${CUDA_INCLUDE_DIR}" in cm,
        has_inc_dir=any(f.startswith("inc/") for f in files))


@dataclass(frozen=True)
class Toolchain:
    """Where things are on the build machine."""
    nvcc: str
    common_include: Path            # cuda-samples' Common/
    arch: str                       # sm_90
    link_dir: Path                  # libcuda.so and unversioned library names
    cuda_libs: Path | None = None   # include/ and lib/ of the CUDA math libraries
    extra_include: Path | None = None   # overrides first (the pinned nvJitLink.h)
    rpath: str | None = None


def compile_command(plan: SamplePlan, tc: Toolchain, sample_dir: Path, binary: Path) -> list[str]:
    """nvcc's command line for the sample's binary."""
    includes = [f"-I{tc.common_include}", f"-I{sample_dir}"]
    if plan.has_inc_dir:
        includes.append(f"-I{sample_dir / 'inc'}")
    if tc.extra_include:
        includes.append(f"-I{tc.extra_include}")
    if tc.cuda_libs:
        includes.append(f"-I{tc.cuda_libs / 'include'}")
    flags = ["-O2", "-std=c++17", *gencode(tc.arch)]
    if plan.rdc:
        flags.append("-rdc=true")
    if plan.extended_lambda:
        flags.append("--extended-lambda")
    link = [f"-L{tc.link_dir}", *[f"-l{lib}" for lib in plan.libraries], "-lcuda"]
    if tc.rpath:
        link.append(f"-Xlinker=-rpath,{tc.rpath}")
    if plan.cudart == "shared":
        link.append("-Xlinker=-rpath,$ORIGIN/../cudart")
    if tc.cuda_libs:
        link.append(f"-Xlinker=-rpath-link,{tc.cuda_libs / 'lib'}")
    return [tc.nvcc, *flags, *includes, "-cudart", plan.cudart, "-o", str(binary),
            *[str(sample_dir / s) for s in plan.sources], *link]


def image_command(image: KernelImage, tc: Toolchain, sample_dir: Path, out_dir: Path) -> list[str]:
    """nvcc's command line for a kernel the sample loads from a file."""
    target = gencode(tc.arch) if image.kind == "fatbin" else [f"-arch={tc.arch}"]
    return [tc.nvcc, f"-I{tc.common_include}", *target, f"-{image.kind}", "-o", str(out_dir / image.output),
            str(sample_dir / image.source)]


def pin_nvjitlink(header: str, abi: str) -> str:
    """nvJitLink.h with its versioned entry points (`__nvJitLinkCreate_13_5`) pinned to `abi`
    (`13_0`): a newer header's names are missing from an older libnvJitLink, while a newer
    library exports every older name."""
    if not re.fullmatch(r"\d+_\d+", abi):
        raise PlanError(f"--nvjitlink-abi {abi!r} is not of the form 13_0")
    return re.sub(r"\b(__nvJitLink\w+?)_\d+_\d+\b", rf"\1_{abi}", header)


def link_name(filename: str) -> str | None:
    """The unversioned name a linker looks for (`libcublas.so`) of a versioned library file
    (`libcublas.so.13`), or None for other files."""
    m = re.fullmatch(r"(lib[\w+-]+\.so)\.\d+(\.\d+)*", filename)
    return m.group(1) if m else None


# ---------------------------------------------------------------------------- cuda-python's examples

# Folders of shared code, not examples: the old in-tree helpers (`common/`) and the package's
# `_example_helpers` copy. Test wrappers (pytest files) are not examples either.
_HELPER_DIRS = frozenset({"common", "_example_helpers", "__pycache__"})


def is_python_example(rel: str) -> bool:
    """Whether `rel` (a path relative to the examples folder, `/`-separated) is an example script:
    a `.py` file outside helper and hidden folders, not a pytest file, conftest, setup or private module."""
    parts = rel.split("/")
    name = parts[-1]
    if not name.endswith(".py") or any(p in _HELPER_DIRS or p.startswith((".", "_")) for p in parts):
        return False
    return not (name.startswith("test_") or name.endswith("_test.py") or name in ("conftest.py", "setup.py"))


def python_examples(rels: list[str]) -> list[tuple[str, str]]:
    """(name, rel) of each example script among `rels`, sorted by path; the name is the file's stem
    (it names the logs). Two examples with one stem are a PlanError naming both."""
    seen: dict[str, str] = {}
    for rel in sorted(r for r in rels if is_python_example(r)):
        stem = rel.rsplit("/", 1)[-1][:-3]
        if stem in seen:
            raise PlanError(f"python examples: {seen[stem]} and {rel} share the name {stem} (rename one copy)")
        seen[stem] = rel
    return [(name, rel) for name, rel in seen.items()]
