"""The README's configuration table lists exactly the keys rgpu.config knows, with their defaults."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

from rgpu.config import KEYS, Settings

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = "| key | default | meaning |"


def readme_table() -> dict[str, str]:
    """{key: default as written} from README's table; a row may name several keys."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER) + 2        # past the header and its | --- | line
    rows: dict[str, str] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        key_cell, default_cell = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for key in re.findall(r"`([a-z_]+)`", key_cell):
            assert key not in rows, f"README's configuration table lists {key} twice"
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


def test_readme_lists_every_config_key_and_no_other() -> None:
    table = readme_table()
    missing, unknown = sorted(set(KEYS) - set(table)), sorted(set(table) - set(KEYS))
    assert not missing and not unknown, (
        f"README.md's configuration table and rgpu/config.py differ: missing {missing}, unknown {unknown} "
        "(add or remove the rows in README.md)")


def test_readme_defaults_are_the_code_defaults() -> None:
    table = readme_table()
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()   # type: ignore[misc]
                for f in fields(Settings) if f.name in KEYS}
    wrong = {k: (table[k], documented_default(v)) for k, v in defaults.items()
             if k in table and table[k] != documented_default(v)}
    assert not wrong, f"README.md's configuration table shows other defaults than rgpu/config.py (README, code): {wrong}"
