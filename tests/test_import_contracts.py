"""Dependencies point one way (docs/architecture.md): the import-linter contracts in
pyproject.toml, run by `lint-imports` on the checkout.

The editable install maps `rgpu.remoting` to remoting/ (and so on) through an import hook, which
import-linter's graph builder cannot follow; so the test lays the checkout out at its import paths
with scripts/package_view.py (symbolic links, nothing copied: what is checked is the checkout's own
files) and checks that, as .ci/run does.
"""

from __future__ import annotations

import importlib.util
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


def package_view(root: Path) -> Path:
    """The checkout at its import paths under `root`, as links (scripts/package_view.py, in-process)."""
    spec = importlib.util.spec_from_file_location("package_view", REPO / "scripts" / "package_view.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(root)


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
    if exe is None:
        pytest.fail("lint-imports is missing: install the test extra (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([exe, "--no-cache", str(PYPROJECT)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.integration   # runs lint-imports
def test_the_import_contracts_hold(tmp_path: Path) -> None:
    run = lint_imports(package_view(tmp_path / "view"))
    assert run.returncode == 0, f"an import breaks a contract in pyproject.toml:\n{run.stdout}\n{run.stderr}"
    count = len(_config()["tool"]["importlinter"]["contracts"])
    assert f"Contracts: {count} kept, 0 broken." in run.stdout, run.stdout


@pytest.mark.integration
def test_a_broken_contract_fails(tmp_path: Path) -> None:
    root = package_view(tmp_path / "view")
    units = root / "rgpu" / "units.py"           # a link into the checkout: replaced, not written through
    text = units.read_text()
    units.unlink()
    units.write_text(text + "\nimport rgpu.remoting.pool.daemon  # a core module importing the pool\n")
    assert "rgpu.remoting" not in (REPO / "rgpu" / "units.py").read_text()
    run = lint_imports(root)
    assert run.returncode != 0, run.stdout
    assert "the core (rgpu/*.py, rgpu.proto) imports no component BROKEN" in run.stdout, run.stdout
    assert "rgpu.units -> rgpu.remoting.pool.daemon" in run.stdout, run.stdout


def test_the_view_links_every_file_of_the_package_and_copies_none(tmp_path: Path) -> None:
    root = package_view(tmp_path / "view")
    assert (root / "rgpu" / "units.py").resolve() == REPO / "rgpu" / "units.py"
    assert (root / "rgpu" / "remoting").resolve() == REPO / "remoting"
    assert (root / "rgpu" / "remoting" / "pool" / "rules.py").is_file()
    assert not [p for p in (root / "rgpu").iterdir() if not p.is_symlink()]


def test_the_core_contracts_name_every_core_module() -> None:
    """A new module in rgpu/ is core, so the core contracts must list it."""
    core = {f"rgpu.{p.stem}" for p in (REPO / "rgpu").glob("*.py") if p.stem != "__init__"}
    contracts = {c["id"]: c for c in _config()["tool"]["importlinter"]["contracts"]}
    assert set(contracts["core-imports-no-component"]["source_modules"]) == core | {"rgpu.proto"}
    assert set(contracts["core-has-no-transport-or-cli"]["source_modules"]) == core


# Every module's imports (function-level ones included) by grimp, the graph builder of import-linter, on
# the view; prints each cycle of modules, then each pair of folders that import each other.
_CYCLES = """
import grimp, sys
graph = grimp.build_graph("rgpu")
edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
sys.setrecursionlimit(20000)
index, low, stack, on, n = {}, {}, [], set(), [0]
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        part = []
        while not part or part[-1] != v:
            part.append(stack.pop()); on.discard(part[-1])
        if len(part) > 1:
            print("modules:", " <-> ".join(sorted(part)))
for m in sorted(edges):
    if m not in index:
        visit(m)
folder = lambda m: m if graph.find_children(m) else m.rsplit(".", 1)[0]
pairs = {(folder(a), folder(b)) for a in edges for b in edges[a]}
for a, b in sorted(pairs):
    if a < b and (b, a) in pairs and not b.startswith(a + ".") and not a.startswith(b + "."):
        print("folders:", a, "<->", b)
"""


@pytest.mark.integration   # runs grimp in a process with the view on its path
def test_no_two_modules_or_folders_import_each_other(tmp_path: Path) -> None:
    """Issue 28: the last knots were backends <-> worker (emulated backend <- worker/faults.py) and
    pool/store.py <-> store_pg.py; a cycle anywhere, direct or through other modules, fails here."""
    root = package_view(tmp_path / "view")
    run = subprocess.run([sys.executable, "-c", _CYCLES], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "", f"import cycles (break each: move the shared piece below both):\n{run.stdout}"
