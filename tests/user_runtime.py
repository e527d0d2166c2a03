"""rgpu installed where another uid can run it: this test run's Python and rgpu's packages, put
into a world-readable folder, so tests run rgpu's real CLIs (rgpu-admin, flexrun) as a user
without the cluster secret.

The interpreter running the tests may live where other users cannot reach (a pyenv or venv under
/root): then its installation (the binary, libpython, the standard library without site-packages
and tests) is linked or copied into the folder; an interpreter other users can run is used as it
is. Packages: rgpu (from wherever it is imported, an editable install included, with its
dist-info for the entry points) and the installed distributions it requires, file by file from
their RECORD, under `site/`, reached through PYTHONPATH. Files are hard links where the file
system allows (same inode, same mode; nothing is made more readable than it was), else copies.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
RGPU_PACKAGES = ("rgpu", "rgpu.proto", "rgpu.remoting", "rgpu.slurm_plugin", "rgpu.prolog", "rgpu.templates",
                 "rgpu.site")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_tree(src: Path, dst: Path, skip: Sequence[str] = (), follow_links: bool = False) -> None:
    shutil.copytree(src, dst, symlinks=not follow_links, dirs_exist_ok=True, copy_function=_link_or_copy,
                    ignore=shutil.ignore_patterns(*skip) if skip else None)


def _requirement_names(dist: md.Distribution) -> list[str]:
    """Names of `dist`'s unconditional requirements (extras left out)."""
    names = []
    for req in dist.requires or []:
        if "extra ==" in req.replace("extra==", "extra =="):
            continue
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if match:
            names.append(match.group(1))
    return names


def _closure(root: str) -> list[md.Distribution]:
    seen: dict[str, md.Distribution] = {}
    todo = [root]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        # Installed metadata first: run from a checkout, the working folder (on sys.path) holds the
        # editable build's rgpu.egg-info, which has no entry points to copy.
        found = sorted(md.distributions(name=name), key=lambda d: not str(getattr(d, "_path", "")).endswith(".dist-info"))
        if not found:
            continue     # an optional or platform-specific requirement that is not installed
        dist = found[0]
        seen[name] = dist
        todo.extend(_requirement_names(dist))
    return list(seen.values())


def runnable_by(user: str, python: str) -> bool:
    done = subprocess.run([RUNUSER, "-u", user, "--", python, "-S", "-c", "import encodings"],
                          capture_output=True, timeout=60, check=False, env={"PATH": "/usr/bin:/bin"})
    return done.returncode == 0


class UserRuntime:
    """A folder with a Python and rgpu that `user` can run: `command(argv, env)` runs
    `python -m ...` as `user` with a clean environment."""

    def __init__(self, user: str) -> None:
        self.user = user
        self.root = Path(tempfile.mkdtemp(prefix="rgpu-user-python-"))
        self.root.chmod(0o755)
        self.site = self.root / "site"
        self.home = self.root / "home"        # the user's HOME and working folder, theirs to write
        self.python = os.path.realpath(sys.executable)
        self.lib_path = ""

    def build(self) -> "UserRuntime":
        try:
            self._install_python()
            self._install_packages()
            self.home.mkdir()
            shutil.chown(self.home, self.user)
        except BaseException:
            self.remove()
            raise
        return self

    def _install_python(self) -> None:
        if runnable_by(self.user, self.python):
            return
        base = Path(sys.base_prefix)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        prefix = self.root / "python"
        (prefix / "bin").mkdir(parents=True)
        _link_or_copy(str(base / "bin" / version), str(prefix / "bin" / version))
        (prefix / "lib").mkdir()
        for lib in (base / "lib").glob("libpython*"):
            _link_or_copy(str(lib), str(prefix / "lib" / lib.name))
        _copy_tree(base / "lib" / version, prefix / "lib" / version, skip=("site-packages", "test", "tests"))
        (prefix / "lib" / version / "site-packages").mkdir()
        self.python = str(prefix / "bin" / version)
        self.lib_path = str(prefix / "lib")    # libpython, where the binary's RUNPATH points under /root

    def _install_packages(self) -> None:
        self.site.mkdir()
        for name in RGPU_PACKAGES:       # in order: a subpackage inside its parent's folder is there already
            target = self.site.joinpath(*name.split("."))
            if not target.exists():
                package = importlib.import_module(name)
                # Links followed: a checkout's rgpu/ links its component folders (rgpu/remoting -> ../remoting).
                _copy_tree(Path(next(iter(package.__path__))), target, skip=("__pycache__",), follow_links=True)
        for dist in _closure("rgpu"):
            for file in dist.files or []:
                if ".." in file.parts or file.parts[0].startswith("__editable__"):
                    continue      # scripts outside site-packages; an editable install's path hooks
                if dist.metadata["Name"] == "rgpu" and not file.parts[0].endswith(".dist-info"):
                    continue      # rgpu's own modules were copied above
                src = Path(str(dist.locate_file(file)))
                if src.is_file():
                    dst = self.site / file
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    _link_or_copy(str(src), str(dst))
        for path in self.root.rglob("*"):
            if path.is_dir():
                path.chmod(0o755)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8",
               "PYTHONPATH": str(self.site), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}
        if self.lib_path:
            env["LD_LIBRARY_PATH"] = self.lib_path
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """`python argv...` as the user, environment exactly `env()` plus `env`, in their HOME."""
        variables = [f"{k}={v}" for k, v in self.env(env).items()]
        return subprocess.run([RUNUSER, "-u", self.user, "--", "env", "-i", *variables, self.python, *argv],
                              capture_output=True, text=True, timeout=timeout, check=False, cwd=self.home)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

