"""Config files and the flexrun runner shared by the flexrun tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rgpu.remoting.native import build
from rgpu.adaptor import AdaptorConf, AdaptorSlice, write_adaptor_conf
from rgpu.tokens import unverified_claims

from tests.remoting.conftest import PY, Server


def conf_for(server: Server, path: Path, *tokens: str) -> Path:
    """An adaptor.conf of these tokens, each slice with its token's limits, as rgpu writes it (flexrun
    refuses a file whose limits are not its tokens')."""
    def limits(token: str) -> tuple[int, int]:
        claims = unverified_claims(token)
        return (claims.memory_limit_bytes, claims.compute_percent) if claims else (1 << 30, 50)
    slices = tuple(AdaptorSlice(server=server.address, gpu_uuid=server.gpus[i % 2].uuid, gpu_index=i % 2,
                                memory_limit_bytes=limits(t)[0], compute_percent=limits(t)[1], token=t)
                   for i, t in enumerate(tokens))
    return write_adaptor_conf(path, AdaptorConf(job_id="1234", user="alice", slices=slices))


def run_flexrun(args: list[str], native_libs: build.Libraries, env_extra: dict[str, str] | None = None,
                timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "SLURM_"))}
    env["RGPU_NATIVE_DIR"] = str(native_libs.folder)
    env["HOME"] = str(Path(env.get("TMPDIR", "/tmp")) / "flexrun-test-home-none")
    env.update(env_extra or {})
    return subprocess.run([PY, "-m", "rgpu.remoting.client.flexrun", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, **kw, check=False)  # type: ignore[arg-type]
