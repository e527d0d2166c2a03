"""Build rgpu's native libraries with the system C compiler: the client libraries (libcuda.so.1,
libnvidia-ml.so.1, libnccl.so.2) and the GPU worker's launch fast path (librgpu-worker.so).

    python -m rgpu.remoting.native.build [--out DIR] [--force]

Needs only a C compiler (cc/gcc; $CC overrides): no CUDA toolkit, no download. The sources and
the generated stubs ship inside the Python package. flexrun calls `ensure_built()` on first use:
it reuses a build whose stamp matches the sources and the compiler, found in (1) $RGPU_NATIVE_DIR,
(2) the package's own `lib/` folder (filled at install time by setup.py's build hook where a C
compiler is present, or by an admin running this module with `--out <package>/lib`), (3) the user's cache ($XDG_CACHE_HOME or ~/.cache)
/rgpu/native/<stamp>, (4) a private folder under the temp dir ($TMPDIR, which Slurm jobs get, else
/tmp) /rgpu-<uid>/native/<stamp>, building into the first of (3) and (4) that can be written: a
job's user may have no writable home (Debian's `nobody` has HOME=/nonexistent). The build is
atomic: a folder is renamed into place only when every library linked.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rgpu.errors import ConfigError

HERE = Path(__file__).parent
SRC = HERE / "src"
GEN = HERE / "generated"
PACKAGE_LIB = HERE / "lib"
STAMP = "rgpu-native.stamp"

CUDA_SOURCES = [SRC / "transport.c", SRC / "tables.c", SRC / "cuda_core.c", SRC / "cuda_memory.c", SRC / "cuda_array.c",
                SRC / "cuda_module.c", SRC / "cuda_graph.c", SRC / "host_nodes.c", SRC / "cuda_cache.c", SRC / "cuda_export.c",
                SRC / "module_nodes.c", SRC / "managed.c", SRC / "library_mirror.c", SRC / "cuda_events.c",
                SRC / "integrity.c", SRC / "sha256.c", SRC / "digest_memo.c", SRC / "idle_streams.c", SRC / "func_attrs.c",
                SRC / "tensor_map.c", SRC / "graph_generic.c", SRC / "ucx_link.c", SRC / "compute_cache.c", SRC / "zero_copy.c",
                SRC / "shared_pinned.c", SRC / "lanes.c", SRC / "nccl_bridge.c", SRC / "error_log.c", GEN / "cuda_gen.c"]
NVML_SOURCES = [SRC / "transport.c", SRC / "nvml_core.c", SRC / "ucx_link.c", SRC / "lanes.c", GEN / "nvml_gen.c"]
NCCL_SOURCES = [SRC / "nccl_client.c", GEN / "nccl_gen.c"]   # rides on libcuda.so.1's sessions (nccl_bridge.c)
WORKER_SOURCES = [SRC / "worker_launch.c", SRC / "worker_events.c", SRC / "worker_copies.c", SRC / "worker_ucx.c",
                  SRC / "worker_lanes.c"]
TRACE_SOURCES = [SRC / "trace.c", SRC / "integrity.c"]
SPEC = HERE / "spec"
TRACE_SPECIAL = {"cuGetProcAddress", "cuGetProcAddress_v2", "cuGetExportTable"}  # written in C (trace.c)
TRACE_DYN_SLOTS = 8192
LIBRARY_NAMES = ("libcuda.so.1", "libnvidia-ml.so.1", "libnccl.so.2", "librgpu-worker.so")
HEADERS = sorted(SRC.glob("*.h")) + sorted(GEN.glob("*.h"))
CFLAGS = ["-O2", "-g", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
          "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]


@dataclass(frozen=True)
class Libraries:
    folder: Path

    @property
    def libcuda(self) -> Path:
        return self.folder / "libcuda.so.1"

    @property
    def libnvml(self) -> Path:
        return self.folder / "libnvidia-ml.so.1"

    @property
    def libnccl(self) -> Path:
        return self.folder / "libnccl.so.2"

    @property
    def libworker(self) -> Path:
        return self.folder / "librgpu-worker.so"


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise ConfigError("native", "no C compiler found to build rgpu's client libraries",
                          "flexrun builds libcuda.so.1 and libnvidia-ml.so.1 on first use",
                          "install gcc (apt-get install gcc), or point RGPU_NATIVE_DIR at a prebuilt copy")
    return cc


def stamp() -> str:
    """A digest of every source and the flags: equal stamps mean an equivalent build."""
    h = hashlib.sha256()
    for path in sorted(set(CUDA_SOURCES + NVML_SOURCES + NCCL_SOURCES + WORKER_SOURCES + TRACE_SOURCES + HEADERS
                           + [SPEC / "cuda_exports.txt", SPEC / "nvml_exports.txt"])):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    # A build made elsewhere (a wheel built at install time on another machine) is no use on a
    # different architecture.
    h.update(platform.machine().encode())
    return h.hexdigest()[:24]


def _matches(folder: Path, want: str) -> bool:
    try:
        return (folder / STAMP).read_text().strip() == want and all((folder / n).exists() for n in LIBRARY_NAMES)
    except OSError:
        return False


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rgpu" / "native"


def temp_cache_root() -> Path:
    """The fallback cache: this uid's own folder under the temp dir ($TMPDIR, else /tmp)."""
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"rgpu-{os.getuid()}" / "native"


def _private_folder(folder: Path) -> None:
    """Make `folder` (under a shared temp dir) this uid's alone, or raise OSError saying why not:
    libraries found there are loaded into applications, so another user's folder is never used."""
    owner = folder.parent
    try:
        owner.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(owner)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(errno.EPERM, f"{owner} is not a private folder of uid {os.getuid()} (another user's, a link, "
                      "or writable by others)")
    folder.mkdir(exist_ok=True)


def _writable_cache(candidates: list[Path]) -> tuple[Path | None, list[str]]:
    """The first cache folder of `candidates` that exists or can be made; why the others cannot."""
    problems: list[str] = []
    for root in candidates:
        try:
            if root == temp_cache_root():
                _private_folder(root)
            else:
                root.mkdir(parents=True, exist_ok=True)
            if not os.access(root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "Permission denied")
            return root, problems
        except OSError as exc:
            problems.append(f"{root}: {exc.strerror or exc}")
    return None, problems


def _link(cc: str, sources: list[Path], out: Path, soname: str) -> None:
    cmd = [cc, *CFLAGS, f"-I{SRC}", f"-I{GEN}", f"-Wl,-soname,{soname}", "-o", str(out),
           *[str(s) for s in sources], "-ldl"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ConfigError("native", f"cannot run the C compiler {cc} to build {soname}", str(exc),
                          "install gcc (apt-get install gcc) or set CC to a working compiler") from exc
    if done.returncode != 0:
        raise ConfigError("native", f"building {soname} failed (exit {done.returncode})",
                          f"command: {' '.join(cmd)}\n{done.stderr.strip()[-4000:]}",
                          "report this with the compiler output above")


def _exports(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _trace_sources(folder: Path, names: list[str], is_cuda: bool) -> list[Path]:
    """The trace library's trampolines: one counting jump per export, and a pool of them for the
    functions cuGetProcAddress and cuGetExportTable hand out (trace.c)."""
    asm = ["    .text"]
    for i, name in enumerate(names):
        asm += [f"    .globl {name}", f"    .type {name},@function", "    .p2align 4", f"{name}:",
                f"    lock incq rgpu_trace_count+{8 * i}(%rip)", f"    jmp *rgpu_trace_real+{8 * i}(%rip)",
                f"    .size {name},.-{name}"]
    asm += ["    .globl rgpu_trace_dyn_base", "    .hidden rgpu_trace_dyn_base", "    .p2align 4", "rgpu_trace_dyn_base:"]
    for i in range(TRACE_DYN_SLOTS):
        asm += ["    .p2align 4", f"    lock incq rgpu_trace_dyn_count+{8 * i}(%rip)",
                f"    jmp *rgpu_trace_dyn_real+{8 * i}(%rip)"]
    asm.append('    .section .note.GNU-stack,"",@progbits')
    (folder / "trace_gen.S").write_text("\n".join(asm) + "\n")
    quoted = ",\n".join(f'    "{n}"' for n in names)
    (folder / "trace_names.c").write_text(
        '#define HIDDEN __attribute__((visibility("hidden")))\n'
        f"HIDDEN const char *const rgpu_trace_names[] = {{\n{quoted}\n}};\n"
        f"HIDDEN const int rgpu_trace_count_n = {len(names)};\n"
        f"HIDDEN const int rgpu_trace_is_cuda = {1 if is_cuda else 0};\n")
    return [folder / "trace_gen.S", folder / "trace_names.c"]


def build_trace(out: Path, cc: str) -> None:
    """trace/libcuda.so.1 and trace/libnvidia-ml.so.1: NVIDIA's libraries, counted (trace.c)."""
    out.mkdir(parents=True, exist_ok=True)
    for soname, spec, is_cuda in (("libcuda.so.1", "cuda_exports.txt", True),
                                  ("libnvidia-ml.so.1", "nvml_exports.txt", False)):
        names = [n for n in _exports(SPEC / spec) if not (is_cuda and n in TRACE_SPECIAL)]
        gen = Path(tempfile.mkdtemp(prefix=".rgpu-trace-", dir=out))
        try:
            _link(cc, TRACE_SOURCES + _trace_sources(gen, names, is_cuda), out / soname, soname)
        finally:
            shutil.rmtree(gen, ignore_errors=True)


def build(out: Path, cc: str | None = None) -> Libraries:
    """Compile the libraries into `out` (replaced atomically)."""
    cc = cc or compiler()
    want = stamp()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".rgpu-build-", dir=out.parent))
    try:
        _link(cc, CUDA_SOURCES, tmp / "libcuda.so.1", "libcuda.so.1")
        _link(cc, NVML_SOURCES, tmp / "libnvidia-ml.so.1", "libnvidia-ml.so.1")
        _link(cc, NCCL_SOURCES, tmp / "libnccl.so.2", "libnccl.so.2")
        _link(cc, WORKER_SOURCES, tmp / "librgpu-worker.so", "librgpu-worker.so")
        build_trace(tmp / "trace", cc)
        # Programs that dlopen the unversioned names find these too.
        os.symlink("libcuda.so.1", tmp / "libcuda.so")
        os.symlink("libnvidia-ml.so.1", tmp / "libnvidia-ml.so")
        os.symlink("libnccl.so.2", tmp / "libnccl.so")
        (tmp / STAMP).write_text(want + "\n")
        os.chmod(tmp, 0o755)
        if out.exists():
            old = out.with_name(out.name + f".old{os.getpid()}")
            out.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Libraries(out)


def ensure_built(on_build: Callable[[], None] | None = None) -> Libraries:
    """The native libraries for this rgpu version, building them into the cache if needed;
    `on_build` is called once before a build starts (not when a matching build is found)."""
    explicit = os.environ.get("RGPU_NATIVE_DIR")
    if explicit:
        folder = Path(explicit)
        missing = [n for n in LIBRARY_NAMES if not (folder / n).exists()]
        if missing:
            raise ConfigError("native", f"RGPU_NATIVE_DIR={folder} has no {', '.join(missing)}",
                              "", "unset it, or fill it with `python -m rgpu.remoting.native.build --out DIR`")
        return Libraries(folder)
    want = stamp()
    candidates = [cache_root(), temp_cache_root()]
    for folder in (PACKAGE_LIB, *(root / want for root in candidates)):
        if _matches(folder, want):
            return Libraries(folder)
    root, problems = _writable_cache(candidates)
    if root is not None:
        if on_build is not None:
            on_build()
        try:
            return build(root / want)
        except OSError as exc:
            problems.append(f"{root}: {exc.strerror or exc}")
    raise ConfigError("native", "no writable folder to build rgpu's client libraries in (libcuda.so.1, "
                      "libnvidia-ml.so.1)", "; ".join(problems),
                      "set XDG_CACHE_HOME or RGPU_NATIVE_DIR to a folder you can write, or have an admin build them "
                      "once into the installed package: python -m rgpu.remoting.native.build --out "
                      "<site-packages>/rgpu/remoting/native/lib")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="build into this folder (default: the user's cache)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    args = parser.parse_args(argv)
    try:
        if args.out:
            libs = build(args.out.resolve())
        elif args.force:
            libs = build(cache_root() / stamp())
        else:
            libs = ensure_built()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code
    print(libs.folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
