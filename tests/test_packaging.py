"""pyproject.toml must ship every Python package and data file of the tree (a non-editable
`pip install .` sees only what is listed), and a built wheel must hold them, each once."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from rgpu import __version__

REPO = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed() -> None:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = tool["package-dir"]
    listed = set(tool["packages"])
    found = set()
    for package, folder in mapping.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join([package, *rel.parts]))
    missing = sorted(found - listed)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"


@pytest.mark.integration   # builds a wheel with pip
def test_the_wheel_holds_each_file_once_and_no_link(tmp_path: Path) -> None:
    """rgpu/remoting -> ../remoting (and the other links in rgpu/) are for tools run on the checkout;
    the build reads the folders through package-dir, so the wheel holds no link and no second tree."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300, check=False,
                           env={**os.environ, "RGPU_NATIVE_AT_INSTALL": "0"})
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("rgpu-*.whl")
    entries = zipfile.ZipFile(wheel).infolist()
    assert not [entry.filename for entry in entries if stat.S_ISLNK(entry.external_attr >> 16)]
    names = [entry.filename for entry in entries]
    assert len(names) == len(set(names))
    assert {name.split("/", 1)[0] for name in names} == {"rgpu", f"rgpu-{__version__}.dist-info",
                                                        f"rgpu-{__version__}.data"}   # .data: the TaskProlog
    assert not [n for n in names if n.startswith(("rgpu/rgpu/", "rgpu/remoting/remoting/"))]
    assert "rgpu/remoting/pool/daemon.py" in names and "rgpu/templates/adaptor.conf.j2" in names
