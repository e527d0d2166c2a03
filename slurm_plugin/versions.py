"""What differs between the Slurm versions rgpu supports (22.05, 24.11, 26.05 tested). Pure.

- `--gres=rgpu:N` shows in tres_per_node as `gres:rgpu:N` up to 23.02, `gres/rgpu:N` from 23.11.
- `scontrol --json` exists from 23.02; 22.05 has only `squeue --json` (all jobs, filters ignored).
- `squeue --json` prints `job_state` as a string up to 23.02 and as a list (base state and flags)
  from 23.11, with numbers as `{set, infinite, number}` objects. 26.05 (data_parser v0.0.45)
  keeps that shape and adds fields (`submit_line`, `licenses_allocated`, `step_id`, ...); its
  `scontrol show job` adds SLUID=, SubmitLine= (the user's command line) and LicensesAlloc=.
- `squeue` hides finished jobs unless asked (`--states=all`; seen on 24.11 and 26.05); 22.05's `--json`
  ignores filters.
- 26.05 adds PrologTimeout and EpilogTimeout beside PrologEpilogTimeout.
"""

from __future__ import annotations

import re

TESTED = ("22.05", "24.11", "26.05")


def version_tuple(version: str) -> tuple[int, int]:
    """'24.11' / '24.11.5' / 'slurm 24.11.5' -> (24, 11); (0, 0) when none is found."""
    m = re.search(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def tres_gres_prefix(version: str) -> str:
    """How tres_per_node spells a GRES: 'gres/' from 23.11, 'gres:' before."""
    return "gres/" if version_tuple(version) >= (23, 11) else "gres:"


def has_scontrol_json(version: str) -> bool:
    return version_tuple(version) >= (23, 2)


def has_split_prolog_timeouts(version: str) -> bool:
    """26.05 adds PrologTimeout and EpilogTimeout (PrologEpilogTimeout remains their default)."""
    return version_tuple(version) >= (26, 5)


def parse_version_output(text: str) -> str:
    """`scontrol --version` ('slurm 24.11.5', 'slurm-wlm 22.05.8') -> '24.11'; '' when none."""
    m = re.search(r"\bslurm(?:-wlm)?\s+(\d+)\.(\d+)", text)
    return f"{m[1]}.{m[2]}" if m else ""
