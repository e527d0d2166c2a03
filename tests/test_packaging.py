"""pyproject.toml must ship every Python package and data file of the tree (a non-editable
`pip install .` sees only what is listed), and a built wheel must hold them."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
