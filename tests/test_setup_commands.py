"""The README's set-up section is two commands, and CI runs the first as a newcomer would (issue 23):
in a fresh clone inside a 0700 folder, without making anything more readable first. The demo's
pure helpers: the emulated GPUs' cap and the folder that keeps other users out."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from rgpu.slurm_plugin.demo import (
    emulated_gpu_memory,
    host_available_memory,
    unreadable_folder,
)

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def setup_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set-up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_the_readme_has_two_setup_commands_demo_then_tests() -> None:
    assert setup_commands() == ["./scripts/demo.sh", "./scripts/test.sh"]


def test_ci_runs_the_readme_demo_command_in_a_fresh_clone_in_a_0700_folder() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    code = "\n".join(line for line in ci.splitlines() if not line.lstrip().startswith("#"))
    assert "chmod" not in code, "CI must not make its folder readable: the newcomer's folder is 0700"
    assert re.search(r'^tmp=\$\(mktemp -d', code, re.MULTILINE)
    assert re.search(r'git clone --quiet "\$checkout" "\$tmp/clone"', code)
    assert re.search(r'cd "\$tmp/clone"\n(?:.*\n)*?\s+\./scripts/demo\.sh\n', code), "CI does not run ./scripts/demo.sh in the clone"
    assert "activate" not in code and "pip install" not in code, "the README's command makes its own venv"
    assert "./scripts/test.sh" in code


def test_emulated_gpus_take_half_the_available_memory_between_them() -> None:
    assert emulated_gpu_memory(24 * GiB) == 3 * GiB              # half of 24 GiB over 4 GPUs
    assert emulated_gpu_memory(1024 * GiB) == 80 << 30           # never more than the inventory describes
    assert emulated_gpu_memory(1 * GiB) == 256 << 20             # a floor a slice still fits in
    assert emulated_gpu_memory(0) == 80 << 30                    # unknown: as described
    assert emulated_gpu_memory(10 * GiB + 12345) % (1 << 20) == 0
    assert host_available_memory("MemTotal: 100 kB\nMemAvailable:    2048 kB\n") == 2 << 20
    assert host_available_memory("MemTotal: 100 kB\n") == 0


def test_unreadable_folder_names_the_outermost_folder_others_cannot_enter() -> None:
    base = Path(tempfile.mkdtemp(prefix="rgpu-unreadable-"))   # not pytest's tmp_path: that is 0700 itself
    try:
        base.chmod(0o755)
        private = base / "home"
        (private / "clone" / "venv" / "bin").mkdir(parents=True)
        python = private / "clone" / "venv" / "bin" / "python"
        python.write_text("")
        private.chmod(0o700)
        (private / "clone").chmod(0o700)
        assert unreadable_folder(python) == private
        private.chmod(0o755)
        (private / "clone").chmod(0o755)
        assert unreadable_folder(python) is None
    finally:
        shutil.rmtree(base)
