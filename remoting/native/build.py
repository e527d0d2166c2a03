"""Build rgpu's native libraries with the system C compiler: the client libraries (libcuda.so.1,
libnvidia-ml.so.1) and the GPU worker's launch fast path (librgpu-worker.so).

    python -m rgpu.remoting.native.build [--out DIR] [--force]

Needs only a C compiler (cc/gcc; $CC overrides): no CUDA toolkit, no download. The sources and
the generated stubs ship inside the Python package. flexrun calls `ensure_built()` on first use:
it reuses a build whose stamp matches the sources and the compiler, found in (1) $RGPU_NATIVE_DIR,
(2) the package's own `lib/` folder (filled at install time by a build hook or an admin running
this module with `--out <package>/lib`), (3) the user's cache ($XDG_CACHE_HOME or ~/.cache)
/rgpu/native/<stamp>, building into (3) when none matches. The build is atomic: a folder is
renamed into place only when every library linked.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rgpu.errors import ConfigError

HERE = Path(__file__).parent
SRC = HERE / "src"
GEN = HERE / "generated"
PACKAGE_LIB = HERE / "lib"
STAMP = "rgpu-native.stamp"

CUDA_SOURCES = [SRC / "transport.c", SRC / "tables.c", SRC / "cuda_core.c", SRC / "cuda_memory.c",
                SRC / "cuda_module.c", SRC / "cuda_export.c", GEN / "cuda_gen.c"]
NVML_SOURCES = [SRC / "transport.c", SRC / "nvml_core.c", GEN / "nvml_gen.c"]
WORKER_SOURCES = [SRC / "worker_launch.c"]
LIBRARY_NAMES = ("libcuda.so.1", "libnvidia-ml.so.1", "librgpu-worker.so")
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
    for path in sorted(set(CUDA_SOURCES + NVML_SOURCES + WORKER_SOURCES + HEADERS)):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:24]


def _matches(folder: Path, want: str) -> bool:
    try:
        return (folder / STAMP).read_text().strip() == want and all((folder / n).exists() for n in LIBRARY_NAMES)
    except OSError:
        return False


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rgpu" / "native"


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


def build(out: Path, cc: str | None = None) -> Libraries:
    """Compile the libraries into `out` (replaced atomically)."""
    cc = cc or compiler()
    want = stamp()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".rgpu-build-", dir=out.parent))
    try:
        _link(cc, CUDA_SOURCES, tmp / "libcuda.so.1", "libcuda.so.1")
        _link(cc, NVML_SOURCES, tmp / "libnvidia-ml.so.1", "libnvidia-ml.so.1")
        _link(cc, WORKER_SOURCES, tmp / "librgpu-worker.so", "librgpu-worker.so")
        # Programs that dlopen the unversioned names find these too.
        os.symlink("libcuda.so.1", tmp / "libcuda.so")
        os.symlink("libnvidia-ml.so.1", tmp / "libnvidia-ml.so")
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


def ensure_built() -> Libraries:
    """The native libraries for this rgpu version, building them into the cache if needed."""
    explicit = os.environ.get("RGPU_NATIVE_DIR")
    if explicit:
        folder = Path(explicit)
        missing = [n for n in LIBRARY_NAMES if not (folder / n).exists()]
        if missing:
            raise ConfigError("native", f"RGPU_NATIVE_DIR={folder} has no {', '.join(missing)}",
                              "", "unset it, or fill it with `python -m rgpu.remoting.native.build --out DIR`")
        return Libraries(folder)
    want = stamp()
    for folder in (PACKAGE_LIB, cache_root() / want):
        if _matches(folder, want):
            return Libraries(folder)
    return build(cache_root() / want)


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
