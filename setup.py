"""Install-time build of rgpu's native client libraries (issue 29).

Everything else is in pyproject.toml. Where a C compiler is present, building the package (`pip
install .`, `python -m build`) compiles libcuda.so.1, libnvidia-ml.so.1 and librgpu-worker.so into
the package's `rgpu/remoting/native/lib/`, which flexrun finds first (remoting/native/build.py), so
a node's first flexrun does not wait ~15 s for them. Without a compiler, or when the build fails,
the install goes on with one line saying so, and flexrun builds them on first use as before.
RGPU_NATIVE_AT_INSTALL=0 skips it. Editable installs (`pip install -e`) skip it too: a checkout
builds into the user's cache on first use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BUILD = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
         "from rgpu.remoting.native.build import build; build(Path(sys.argv[2]))")


class BuildPyWithNative(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("RGPU_NATIVE_AT_INSTALL", "1") == "0":
            return
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if not cc:
            print("rgpu: install: no C compiler here; flexrun builds the client libraries on first use", file=sys.stderr)
            return
        root = Path(self.build_lib).resolve()
        out = root / "rgpu" / "remoting" / "native" / "lib"
        print(f"rgpu: install: building the client libraries into {out} (about 15 s)...", file=sys.stderr)
        done = subprocess.run([sys.executable, "-c", BUILD, str(root), str(out)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or ["no message"])[-1]
            print(f"rgpu: install: the client libraries did not build ({why}); flexrun builds them on first use",
                  file=sys.stderr)


setup(cmdclass={"build_py": BuildPyWithNative})
