"""Dependencies point one way (README, "Architecture"): the import-linter contracts in
pyproject.toml, run by `lint-imports` on the package's import layout.

The editable install maps `rgpu.remoting` to remoting/ (and so on) through an import hook, which
import-linter's graph builder cannot follow; so the test lays the package out as it installs (a
copy of its .py files, folder by folder, after pyproject's package-dir mapping) and checks that.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = REPO / "pyproject.toml"


def _config() -> dict:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


def _folder(package: str, package_dir: dict[str, str]) -> Path:
    """The source folder of `package` under setuptools' package-dir mapping (longest prefix wins)."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return REPO / package_dir[prefix] / Path(*parts[n:])
    return REPO / Path(*parts)


def installed_layout(root: Path) -> Path:
    """The package's .py files under `root`, at their import paths."""
    setuptools = _config()["tool"]["setuptools"]
    for package in setuptools["packages"]:
        source = _folder(package, setuptools.get("package-dir", {}))
        target = root / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for path in source.glob("*.py"):
            shutil.copy2(path, target / path.name)
    return root


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
    if exe is None:
        pytest.fail("lint-imports is missing: install the test extra (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([exe, "--config", str(PYPROJECT), "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.integration   # runs lint-imports
def test_the_import_contracts_hold(tmp_path: Path) -> None:
    run = lint_imports(installed_layout(tmp_path))
    assert run.returncode == 0, f"an import breaks a contract in pyproject.toml:\n{run.stdout}\n{run.stderr}"
    count = len(_config()["tool"]["importlinter"]["contracts"])
    assert f"Contracts: {count} kept, 0 broken." in run.stdout, run.stdout


@pytest.mark.integration
def test_a_broken_contract_fails(tmp_path: Path) -> None:
    root = installed_layout(tmp_path)
    units = root / "rgpu" / "units.py"
    units.write_text(units.read_text() + "\nimport rgpu.remoting.pool.daemon  # a core module importing the pool\n")
    run = lint_imports(root)
    assert run.returncode != 0, run.stdout
    assert "the core (rgpu/*.py, rgpu.proto) imports no component BROKEN" in run.stdout, run.stdout
    assert "rgpu.units -> rgpu.remoting.pool.daemon" in run.stdout, run.stdout


def test_the_core_contracts_name_every_core_module() -> None:
    """A new module in rgpu/ is core, so the core contracts must list it."""
    core = {f"rgpu.{p.stem}" for p in (REPO / "rgpu").glob("*.py") if p.stem != "__init__"}
    contracts = {c["id"]: c for c in _config()["tool"]["importlinter"]["contracts"]}
    assert set(contracts["core-imports-no-component"]["source_modules"]) == core | {"rgpu.proto"}
    assert set(contracts["core-has-no-transport-or-cli"]["source_modules"]) == core
