#!/usr/bin/env python3
"""Lay the checkout out at its import paths, as symbolic links: `python3 scripts/package_view.py DIR`.

The design keeps components in top-level folders (remoting/, slurm_plugin/, prolog/, templates/,
site/) that install as `rgpu.remoting` and so on (pyproject's [tool.setuptools] package-dir). Tools
that read a package from the file system (mypy, import-linter) need `rgpu/remoting/...` on disk, so
DIR/rgpu gets one link per file of rgpu/ and one link per mapped folder, read from pyproject.toml:
nothing is copied, and an edit in the checkout is what the tools see.

    python3 scripts/package_view.py /tmp/view && cd /tmp/view && mypy --config-file CHECKOUT/pyproject.toml
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def build(root: Path, checkout: Path = CHECKOUT) -> Path:
    """DIR/<top package> with links into `checkout`; returns DIR. DIR must not hold that package yet."""
    setuptools = tomllib.loads((checkout / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    tops = {name for name in package_dir if "." not in name}
    if len(tops) != 1:
        raise SystemExit(f"rgpu: package_view: expected one top package in package-dir, found {sorted(tops)}")
    top = tops.pop()
    target = root / top
    target.mkdir(parents=True)
    # The top package's own files, one link each (its subfolders that are packages too).
    for path in sorted((checkout / package_dir[top]).iterdir()):
        if path.name != "__pycache__":
            (target / path.name).symlink_to(path)
    # Each folder mapped under it, one link for the whole folder.
    for name, folder in sorted(package_dir.items()):
        if name == top:
            continue
        if not name.startswith(top + ".") or name.count(".") != 1:
            raise SystemExit(f"rgpu: package_view: package-dir maps {name!r}; only {top}.<folder> is laid out")
        link = target / name.split(".", 1)[1]
        if link.exists() or link.is_symlink():
            raise SystemExit(f"rgpu: package_view: {package_dir[top]}/{link.name} and {folder}/ would both be {name}")
        link.symlink_to(checkout / folder, target_is_directory=True)
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 scripts/package_view.py DIR (an empty or missing folder)")
    print(build(Path(sys.argv[1]).resolve()))
