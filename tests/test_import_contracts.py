"""Dependencies point one way (docs/architecture.md): the import-linter contracts in
pyproject.toml, run by `lint-imports` on the checkout as it is.

The component folders (remoting/, slurm_plugin/, ...) install as `rgpu.remoting` and so on
(pyproject's [tool.setuptools] package-dir); the checkout's rgpu/ holds one relative link per such
folder (rgpu/remoting -> ../remoting), so `rgpu.*` resolves from the checkout root with the same
files, and lint-imports, mypy and `python -c 'import rgpu.remoting...'` run there with no view
and no copy (issue 28, finding 4).
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
# Without PYTHONPATH: what is checked is what the checkout root itself resolves.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _config() -> dict:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


def _component_folders() -> dict[str, str]:
    """{link name under rgpu/: folder} for each package-dir entry other than the top package."""
    package_dir: dict[str, str] = _config()["tool"]["setuptools"]["package-dir"]
    return {name.split(".", 1)[1]: folder for name, folder in package_dir.items() if name != "rgpu"}


def lint_imports(*config: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
    if exe is None:
        pytest.fail("lint-imports is missing: install the test extra (pip install -e '.[test]')")
    return subprocess.run([exe, "--no-cache", *map(str, config)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=300, check=False)


def test_rgpu_links_each_component_folder_and_nothing_else() -> None:
    folders = _component_folders()
    links = {p.name: os.readlink(p) for p in (REPO / "rgpu").iterdir() if p.is_symlink()}
    assert links == {name: f"../{folder}" for name, folder in folders.items()}, \
        "rgpu/ must hold one relative link per package-dir folder: cd rgpu && ln -s ../FOLDER NAME"
    for name, folder in folders.items():
        assert (REPO / "rgpu" / name).resolve() == REPO / folder


@pytest.mark.integration   # runs git
def test_git_stores_the_links_as_links() -> None:
    """A checkout on a file system without links would get text files holding the target instead."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-s", "rgpu"], capture_output=True, text=True,
                            check=False)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    modes = {line.split("\t")[1]: line.split()[0] for line in listed.stdout.splitlines()}
    assert {f"rgpu/{name}": modes.get(f"rgpu/{name}") for name in _component_folders()} == \
        {f"rgpu/{name}": "120000" for name in _component_folders()}


@pytest.mark.integration   # starts a Python
def test_every_component_imports_from_the_checkout_root_without_an_install() -> None:
    """`python -S`: no site-packages, so no installed or editable rgpu; only the checkout root (the cwd)."""
    names = sorted(_component_folders())
    code = ("import importlib\n"
            f"for name in {names!r}:\n"
            "    print(importlib.import_module('rgpu.' + name).__file__)\n")
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(REPO / "rgpu" / name / "__init__.py") for name in names]


@pytest.mark.integration   # runs lint-imports
def test_the_import_contracts_hold() -> None:
    run = lint_imports()      # plain: pyproject.toml of the cwd, the checkout root
    assert run.returncode == 0, f"an import breaks a contract in pyproject.toml:\n{run.stdout}\n{run.stderr}"
    count = len(_config()["tool"]["importlinter"]["contracts"])
    assert f"Contracts: {count} kept, 0 broken." in run.stdout, run.stdout


# A contract the code breaks (the daemon serves through the servicer), added to the checkout's own.
_BROKEN = """
[[tool.importlinter.contracts]]
id = "broken-on-purpose"
name = "the pool daemon imports no servicer (broken on purpose)"
type = "forbidden"
source_modules = ["rgpu.remoting.pool.daemon"]
forbidden_modules = ["rgpu.remoting.pool.servicer"]
"""


@pytest.mark.integration
def test_a_broken_contract_fails(tmp_path: Path) -> None:
    config = tmp_path / "pyproject.toml"
    config.write_text(PYPROJECT.read_text(encoding="utf-8") + _BROKEN, encoding="utf-8")
    run = lint_imports(config)
    assert run.returncode != 0, run.stdout
    assert "the pool daemon imports no servicer (broken on purpose) BROKEN" in run.stdout, run.stdout
    assert "rgpu.remoting.pool.daemon -> rgpu.remoting.pool.servicer" in run.stdout, run.stdout
    count = len(_config()["tool"]["importlinter"]["contracts"])
    assert f"Contracts: {count} kept, 1 broken." in run.stdout, run.stdout


def test_the_core_contracts_name_every_core_module() -> None:
    """A new module in rgpu/ is core, so the core contracts must list it."""
    core = {f"rgpu.{p.stem}" for p in (REPO / "rgpu").glob("*.py") if p.stem != "__init__"}
    contracts = {c["id"]: c for c in _config()["tool"]["importlinter"]["contracts"]}
    assert set(contracts["core-imports-no-component"]["source_modules"]) == core | {"rgpu.proto"}
    assert set(contracts["core-has-no-transport-or-cli"]["source_modules"]) == core


# Every module's imports (function-level ones included) by grimp, the graph builder of import-linter, on
# the checkout root; prints each cycle of modules, then each pair of folders that import each other.
_CYCLES = """
import grimp, sys
graph = grimp.build_graph("rgpu")
if "rgpu.remoting.pool.daemon" not in graph.modules:
    sys.exit("grimp found no rgpu.remoting in the checkout: is the link rgpu/remoting -> ../remoting missing?")
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


@pytest.mark.integration   # runs grimp in a process started in the checkout root
def test_no_two_modules_or_folders_import_each_other() -> None:
    """Issue 28: the last knots were backends <-> worker (emulated backend <- worker/faults.py) and
    pool/store.py <-> store_pg.py; a cycle anywhere, direct or through other modules, fails here."""
    run = subprocess.run([sys.executable, "-c", _CYCLES], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "", f"import cycles (break each: move the shared piece below both):\n{run.stdout}"
