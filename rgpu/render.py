"""One Jinja2 environment for every template rgpu renders.

StrictUndefined makes a missing value an error instead of an empty string; `toml_str` quotes a
value as a TOML basic string. Callers validate values before rendering, so quoting is a second
line of defence, not the only one.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

import rgpu.templates


def toml_str(value: object) -> str:
    # A JSON string with ensure_ascii is a valid TOML basic string: only \" \\ \uXXXX escapes.
    return json.dumps(str(value), ensure_ascii=True)


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(rgpu.templates.__file__).parent),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["toml_str"] = toml_str
    return env


def render(template_name: str, **values: Any) -> str:
    return environment().get_template(template_name).render(**values)
