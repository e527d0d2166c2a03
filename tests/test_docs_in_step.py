"""The manual keeps in step with the code: the configuration page (docs/configuration.md) lists exactly
the keys rgpu.config knows, with their defaults, and every RGPU_* variable the code reads; every link
of the README and of the docs/ pages leads to a file (and heading) that exists."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

from rgpu.config import KEYS, Settings

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CONFIGURATION = REPO / "docs" / "configuration.md"
HEADER = "| key | default | meaning |"


def readme_table() -> dict[str, str]:
    """{key: default as written} from the configuration page's table; a row may name several keys."""
    lines = CONFIGURATION.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER) + 2        # past the header and its | --- | line
    rows: dict[str, str] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        key_cell, default_cell = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for key in re.findall(r"`([a-z_]+)`", key_cell):
            assert key not in rows, f"docs/configuration.md's table lists {key} twice"
            rows[key] = default_cell
    return rows


def documented_default(value: object) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int):
        return f"`{value}`"     # exact: `:g` writes 4 GiB as 4.29497e+09
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`" if value else "empty"


def test_the_configuration_page_lists_every_config_key_and_no_other() -> None:
    table = readme_table()
    missing, unknown = sorted(set(KEYS) - set(table)), sorted(set(table) - set(KEYS))
    assert not missing and not unknown, (
        f"docs/configuration.md's table and rgpu/config.py differ: missing {missing}, unknown {unknown} "
        "(add or remove the rows in docs/configuration.md)")


def test_the_configuration_page_defaults_are_the_code_defaults() -> None:
    table = readme_table()
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()   # type: ignore[misc]
                for f in fields(Settings) if f.name in KEYS}
    wrong = {k: (table[k], documented_default(v)) for k, v in defaults.items()
             if k in table and table[k] != documented_default(v)}
    assert not wrong, f"docs/configuration.md's table shows other defaults than rgpu/config.py (page, code): {wrong}"


# How the code reads an environment variable: Python (os.environ, a mapping's get/pop/setdefault, the
# dispatcher's RGPU_/BF_ lookup), C (getenv and the env_* helpers of the client libraries), shell.
_PY_READ = re.compile(r"""(?:\.get|\.pop|\.setdefault|getenv|environ\[|env\[)\(?\s*["'](RGPU_[A-Z0-9_]+)["']"""
                      r"""|["'](RGPU_[A-Z0-9_]+)["']\s+(?:not\s+)?in\s+(?:os\.)?(?:environ|env)\b""")
_NODE_ENV_READ = re.compile(r'lookup\(env, "([A-Z_]+)"\)')
_C_READ = re.compile(r'(?:getenv|env_[a-z0-9_]+)\(\s*"(RGPU_[A-Z0-9_]+)"')
_SH_READ = re.compile(r"\$\{?(RGPU_[A-Z0-9_]+)")


def variables_the_code_reads() -> dict[str, str]:
    """{RGPU_* variable: a file that reads it} over the hand-written sources (generated code reads none)."""
    found: dict[str, str] = {}
    files = [p for folder in ("rgpu", "remoting", "slurm_plugin", "prolog", "templates")
             for p in (REPO / folder).rglob("*") if p.is_file() and "generated" not in p.parts]
    for path in [*files, *(REPO / "scripts").glob("*.sh")]:
        if path.suffix == ".py":
            text = path.read_text(encoding="utf-8")
            names = [a or b for a, b in _PY_READ.findall(text)] + ["RGPU_" + n for n in _NODE_ENV_READ.findall(text)]
        elif path.suffix in (".c", ".h"):
            names = _C_READ.findall(path.read_text(encoding="utf-8"))
        elif path.suffix in (".sh", ".j2") or path.name == "rgpu-task-prolog":
            names = _SH_READ.findall(path.read_text(encoding="utf-8"))
        else:
            continue
        for name in names:
            found.setdefault(name, str(path.relative_to(REPO)))
    return found


def test_the_configuration_page_names_every_environment_variable_the_code_reads() -> None:
    page = CONFIGURATION.read_text(encoding="utf-8")
    read = variables_the_code_reads()
    assert "RGPU_SLICES" in read and "RGPU_VISIBLE_DEVICES" in read and "RGPU_LANES" in read   # the scan works
    as_keys = {"RGPU_" + key.upper() for key in KEYS}     # RGPU_<KEY>: the key's row documents it
    missing = {name: where for name, where in sorted(read.items())
               if name not in as_keys and f"`{name}`" not in page}
    assert not missing, (f"docs/configuration.md does not name these variables the code reads (variable: a file "
                         f"that reads it): {missing}; add a row to its Environment variables tables")


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue                        # http(s), mailto: not checked here
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(f"{target} (no file {path_part})")
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{anchor} in {path_part or page.name})")
    return broken


def test_every_docs_page_the_readme_links_exists_and_every_page_is_linked() -> None:
    readme = README.read_text(encoding="utf-8")
    linked = {t.partition("#")[0] for t in _LINK.findall(readme) if t.startswith("docs/")}
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert CONFIGURATION.exists() and linked, "the README links no docs/ page"
    assert linked == pages, f"README's links to docs/ and the pages in docs/ differ: linked {sorted(linked)}, pages {sorted(pages)}"


def test_every_relative_link_of_the_readme_and_the_docs_pages_resolves() -> None:
    broken = {str(p.relative_to(REPO)): b for p in [README, *sorted((REPO / "docs").glob("*.md"))]
              if (b := broken_links(p))}
    assert not broken, f"links to files or headings that do not exist: {broken}"
