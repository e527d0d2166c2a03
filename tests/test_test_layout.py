"""No test module imports another, nor does a benchmark (issue 28): what tests share lives in a helper module beside them
(tests/daemons.py, tests/remoting/client_helpers.py, ...) or, for fixtures, in the folder's
conftest.py. A test module that imports another ties itself to that file's module-level code and
fixtures, so a change to one test file silently changes others."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _module_of(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts)


def imported_test_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) for each import in `path` of a test_*.py module (absolute or relative)."""
    package = _module_of(path, root).rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            # `from tests.remoting import test_x` imports a module as a name
            modules = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        found += [(node.lineno, m) for m in modules if m.rsplit(".", 1)[-1].startswith("test_")]
    return found


def imports_of_test_modules(root: Path) -> list[str]:
    """'FILE:LINE imports MODULE' for every file under `root` that imports a test module."""
    return [f"{path.relative_to(root.parent)}:{line} imports {module}"
            for path in sorted(root.rglob("*.py")) for line, module in imported_test_modules(path, root)]


def test_no_file_under_tests_or_benchmarks_imports_a_test_module() -> None:
    found = imports_of_test_modules(TESTS) + imports_of_test_modules(TESTS.parent / "benchmarks")
    assert not found, ("tests: these files import test modules; move what they share into a helper module "
                       "beside them (tests/remoting/*_helpers.py) or, for a fixture, into the folder's "
                       "conftest.py:\n" + "\n".join(found))


def test_the_check_sees_absolute_relative_and_module_imports(tmp_path: Path) -> None:
    root = tmp_path / "tests"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "test_a.py").write_text("X = 1\n")
    (root / "sub" / "helpers.py").write_text("Y = 2\n")
    (root / "sub" / "test_b.py").write_text(
        "from tests.sub.test_a import X\n"
        "from .test_a import X\n"
        "from tests.sub import test_a\n"
        "import tests.sub.test_a\n"
        "def f():\n    from . import test_a\n"
        "from tests.sub.helpers import Y\n"
        "from .helpers import Y\n")
    found = imports_of_test_modules(root)
    assert [f.split(" imports ")[0] for f in found] == [f"tests/sub/test_b.py:{n}" for n in (1, 2, 3, 4, 6)]
    assert all(f.endswith("tests.sub.test_a") for f in found), found
