"""Setting top-level string keys of rgpu.toml in place (what `install-units` writes there).

`with_keys` is pure: a key already set on a line of its own before any table has that line
replaced; a missing key is added at the top, where it is sure to be top level. Comments and every
other line stay as the admin wrote them.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

from rgpu.errors import ConfigError

COMPONENT = "install-units"


def _line(key: str, value: str) -> str:
    return f"{key} = {json.dumps(value)}"   # a JSON string is a TOML basic string


def with_keys(text: str, values: dict[str, str], source: str = "rgpu.toml") -> str:
    """`text` with each key of `values` set to its string value."""
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(COMPONENT, f"{source} is not valid TOML", str(exc), "fix the file first") from None
    lines = text.splitlines()
    missing = dict(values)
    for number, line in enumerate(lines):
        if line.lstrip().startswith("["):
            break   # a table: keys below it are not top level
        match = re.match(r"\s*([A-Za-z0-9_-]+)\s*=", line)
        if match and match.group(1) in missing:
            key = match.group(1)
            lines[number] = _line(key, missing.pop(key))
    head = [_line(key, value) for key, value in missing.items()]
    result = "\n".join(head + lines) + "\n"
    parsed = tomllib.loads(result)
    wrong = [key for key, value in values.items() if parsed.get(key) != value]
    if wrong:   # e.g. a key written over several lines, which this edit does not rewrite
        raise ConfigError(COMPONENT, f"cannot set {', '.join(wrong)} in {source}", "they are written in a form "
                          "this edit does not change", f"set them by hand: {'; '.join(_line(k, values[k]) for k in wrong)}")
    return result


def set_keys(path: Path, values: dict[str, str]) -> None:
    """Set `values` in the config file at `path` (made, mode 0644, if absent), atomically."""
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        new = with_keys(text, values, str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new, encoding="utf-8")
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(COMPONENT, f"cannot update {path}", exc.strerror or str(exc),
                          "run as root, or give --config a writable file") from None
