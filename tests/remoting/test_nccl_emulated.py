"""NCCL through rgpu on the emulated GPU (issue 27): rgpu's libnccl.so.2 carries the collectives to the
slices' workers, which run them on host memory among themselves over TCP. Two and four ranks, one
process per rank (each its own slice) and one process with every slice (ncclCommInitAll), on one and
on several session servers (dispatchers); results equal numpy's. A rank whose worker dies fails the
other ranks' next collective with one line naming it, and nothing hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from rgpu.remoting.client import flexrun
from rgpu.remoting.native import apispec, build

from .conftest import EMULATED_GPU, EMULATED_GPU_2, PY, Server, client_env, serving
from .flexrun_helpers import conf_for, run_flexrun
from .nccl_helpers import COUNT, _check, _check_outputs, _expected_more, _expected_scale, _scale_lines


def _servers(stack: ExitStack, n: int) -> list[Server]:
    return [stack.enter_context(serving("emulated", [EMULATED_GPU, EMULATED_GPU_2])) for _ in range(n)]


def _rank_processes(libs: build.Libraries, binary: Path, servers: list[Server], nranks: int, tmp: Path,
                    argv: list[str] | None = None, **env: str) -> list[subprocess.Popen[str]]:
    procs = []
    for rank in range(nranks):
        s = servers[rank % len(servers)]
        slices = s.slices(s.token(memory_limit=256 << 20, job_key=f"rank{rank}"))
        args = argv or ["rank", str(rank), str(nranks), str(tmp / "id"), str(COUNT), str(tmp / f"out.{rank}")]
        if argv:
            args = [a.replace("{rank}", str(rank)) for a in argv]
        procs.append(subprocess.Popen([str(binary), *args], env=client_env(libs, slices, **env), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize(("nranks", "dispatchers"), [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_collectives_of_ranks_in_their_own_processes_equal_numpys(
        nccl_ranks: Path, native_libs: build.Libraries, tmp_path: Path, nranks: int, dispatchers: int) -> None:
    with ExitStack() as stack:
        servers = _servers(stack, dispatchers)
        procs = _rank_processes(native_libs, nccl_ranks, servers, nranks, tmp_path)
        outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and out.strip() == "OK", f"rank {rank}: {out}{err}"
        _check(tmp_path / f"out.{rank}", rank, nranks)


@pytest.mark.parametrize(("ndev", "dispatchers"), [(2, 1), (2, 2), (4, 2)])
def test_collectives_and_a_grouped_split_of_every_slice_of_one_process_equal_numpys(
        nccl_ranks: Path, native_libs: build.Libraries, tmp_path: Path, ndev: int, dispatchers: int) -> None:
    with ExitStack() as stack:
        servers = _servers(stack, dispatchers)
        # slice d on dispatcher d % dispatchers; two slices of one dispatcher on its two GPUs
        toks = []
        for d in range(ndev):
            s = servers[d % dispatchers]
            gpu = s.gpus[(d // dispatchers) % len(s.gpus)]
            toks.append(f"{s.address},{s.token(memory_limit=256 << 20, gpu=gpu, job_key='one-process')}")
        done = subprocess.run([str(nccl_ranks), "all", str(ndev), str(COUNT), str(tmp_path / "out")],
                              env=client_env(native_libs, ";".join(toks)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    for d in range(ndev):
        _check(tmp_path / f"out.{d}", d, ndev, split_halves=True)


def _worker_pid(server: Server, job_key: str) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for s in server.server.status()["sessions"]:
            if s["job_key"] == job_key and s["mode"] == "cuda":
                return int(s["pid"])
        time.sleep(0.05)
    raise AssertionError(f"no session of {job_key}: {server.server.status()['sessions']}")


def _kill_a_rank_midway(binary: Path, libs: build.Libraries, servers: list[Server], tmp_path: Path,
                        **env: str) -> tuple[int, str, str]:
    """Two ranks all-reduce once; rank 1's worker is SIGKILLed; rank 0 all-reduces again and synchronizes.
    Returns rank 0's (exit code, stdout, stderr)."""
    go = tmp_path / "go"
    procs = _rank_processes(libs, binary, servers, 2, tmp_path, ["die", "{rank}", "2", str(tmp_path / "id"), str(go)],
                            **env)
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "READY", p.communicate(timeout=30)
        os.kill(_worker_pid(servers[-1], "rank1"), signal.SIGKILL)
        go.touch()
        out, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return procs[0].returncode, out, err


def test_a_rank_whose_worker_dies_fails_the_others_with_one_line_and_nothing_hangs(
        nccl_ranks: Path, native_libs: build.Libraries, tmp_path: Path) -> None:
    with ExitStack() as stack:
        code, out, err = _kill_a_rank_midway(nccl_ranks, native_libs, _servers(stack, 2), tmp_path)
    assert code == 7, out + err
    lines = [line for line in err.splitlines() if "ncclAllReduce" in line]
    assert lines == ["rgpu: worker: ncclAllReduce (emulated NCCL, rank 0 of 2): rank 1's worker went away (its "
                     "connection closed); the communicator is aborted"], err
    assert "synchronize 999 async_error 6" in out, out


def test_a_rank_that_never_comes_fails_the_join_after_the_timeout_with_one_line(
        nccl_ranks: Path, native_libs: build.Libraries, emulated: Server, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_NCCL_TIMEOUT_S", "1")
    (p,) = _rank_processes(native_libs, nccl_ranks, [emulated], 1, tmp_path,
                           ["rank", "0", "2", str(tmp_path / "id"), "10", str(tmp_path / "out")])
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, out + err
    assert [line for line in err.splitlines() if line.startswith("rgpu: worker:")] == [
        "rgpu: worker: ncclCommInitRank (emulated NCCL): rank 0 of 2 could not join: not every rank joined within 1 s "
        "(RGPU_NCCL_TIMEOUT_S)"], err


def test_on_the_real_gpu_path_a_rank_whose_worker_dies_fails_the_others_and_nothing_hangs(
        nccl_ranks: Path, native_libs: build.Libraries, chained: Server, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The "cuda" workers (nccl_cuda.py, its watchdog included) chained to emulated ones, as above."""
    monkeypatch.setenv("RGPU_NCCL_LIBRARY", str(native_libs.libnccl))
    monkeypatch.setenv("RGPU_NCCL_WATCHDOG_S", "0.1")
    code, out, err = _kill_a_rank_midway(nccl_ranks, native_libs, [chained], tmp_path)
    assert code == 7, out + err
    assert "synchronize 999 async_error 6" in out, out + err


def test_the_real_gpu_workers_nccl_path_runs_chained_to_emulated_workers(
        nccl_ranks: Path, native_libs: build.Libraries, chained: Server, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """backends/nccl_cuda.py without a GPU: the "cuda" workers load rgpu's own libnccl.so.2 as their
    NCCL (RGPU_NCCL_LIBRARY), which carries their calls to emulated workers; every NCCL call of the
    real-GPU path runs (dlopen, ids, the join thread, groups, collectives by exact symbol)."""
    monkeypatch.setenv("RGPU_NCCL_LIBRARY", str(native_libs.libnccl))
    monkeypatch.setenv("RGPU_LOG", "warn")   # the workers' own client (of the emulated workers) says why, if it must
    procs = _rank_processes(native_libs, nccl_ranks, [chained], 2, tmp_path)
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and out.strip() == "OK", f"rank {rank}: {out}{err}"
        _check(tmp_path / f"out.{rank}", rank, 2)


def test_a_gpu_node_without_nccl_refuses_it_with_one_line(nccl_ranks: Path, native_libs: build.Libraries,
                                                          chained: Server, tmp_path: Path,  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_NCCL_LIBRARY", str(tmp_path / "no-such" / "libnccl.so.2"))
    procs = _rank_processes(native_libs, nccl_ranks, [chained], 1, tmp_path)
    out, err = procs[0].communicate(timeout=60)
    assert procs[0].returncode == 3, out + err
    lines = [line for line in err.splitlines() if "NCCL" in line]
    assert lines[0].startswith(f"rgpu: worker: NCCL is not installed on GPU node {chained.address} (cannot load "
                               f"{tmp_path / 'no-such' / 'libnccl.so.2'}: "), err
    assert lines[0].endswith("install NCCL there, e.g. pip install nvidia-nccl-cu13, and point RGPU_NCCL_LIBRARY in "
                             "the dispatcher's environment at its libnccl.so.2)"), err
    assert "ncclGetUniqueId(&id) -> NCCL 2 (unhandled system error" in err, err


def test_two_ranks_run_through_flexrun(nccl_ranks: Path, native_libs: build.Libraries, emulated: Server,
                                       tmp_path: Path) -> None:
    """What a job's tasks do (`srun -n 2 flexrun -- ./app`): each rank's flexrun puts rgpu's libraries,
    libnccl.so.2 among them, first on the library path; here each rank has an adaptor.conf of its own slice."""
    def rank(r: int) -> subprocess.CompletedProcess[str]:
        conf = conf_for(emulated, tmp_path / f"adaptor.{r}.conf", emulated.token(memory_limit=256 << 20))
        return run_flexrun(["-f", str(conf), "--", str(nccl_ranks), "rank", str(r), "2", str(tmp_path / "id"), str(COUNT),
                            str(tmp_path / f"out.{r}")], native_libs, timeout=120)
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(rank, range(2)))
    for r, d in enumerate(done):
        assert d.returncode == 0 and d.stdout.strip() == "OK", f"rank {r}: {d.stdout}{d.stderr}"
        _check(tmp_path / f"out.{r}", r, 2)


REMOTED = ["ncclCommSplit", "ncclCommShrink", "ncclCommInitRankScalable", "ncclCommFinalize", "ncclRedOpCreatePreMulSum", "ncclRedOpDestroy", "ncclAlltoAll",
           "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitAll", "ncclCommInitRankConfig",
           "ncclCommDestroy", "ncclCommAbort", "ncclCommGetAsyncError", "ncclCommCount", "ncclCommCuDevice",
           "ncclCommUserRank", "ncclGroupStart", "ncclGroupEnd", "ncclAllReduce", "ncclBroadcast", "ncclBcast",
           "ncclReduce", "ncclAllGather", "ncclReduceScatter", "ncclSend", "ncclRecv", "ncclGetErrorString",
           "ncclGetLastError"]


# nm -D --undefined-only libtorch_cuda.so (torch 2.11.0+cu130): every NCCL name PyTorch imports.
TORCH_2_11 = ("ncclAllGather ncclAllReduce ncclAlltoAll ncclBcast ncclBroadcast ncclCommAbort ncclCommCount "
              "ncclCommDeregister ncclCommDestroy ncclCommFinalize ncclCommGetAsyncError ncclCommInitAll "
              "ncclCommInitRank ncclCommInitRankConfig ncclCommInitRankScalable ncclCommRegister ncclCommShrink "
              "ncclCommSplit ncclCommUserRank ncclCommWindowDeregister ncclCommWindowRegister ncclDevCommCreate "
              "ncclDevCommDestroy ncclGetErrorString ncclGetLastError ncclGetUniqueId ncclGetVersion ncclGroupEnd "
              "ncclGroupSimulateEnd ncclGroupStart ncclMemAlloc ncclMemFree ncclRecv ncclRedOpCreatePreMulSum "
              "ncclRedOpDestroy ncclReduce ncclReduceScatter ncclSend").split()


def test_libnccl_exports_only_nccl_names_and_the_rest_of_the_api_says_not_yet(native_libs: build.Libraries) -> None:
    names = subprocess.run(["nm", "-D", "--defined-only", str(native_libs.libnccl)], capture_output=True, text=True,
                           check=True).stdout.split()[2::3]
    assert set(REMOTED) <= set(names) and all(n.startswith("nccl") for n in names), names
    nccl_230 = apispec.read_exports(apispec.SPEC_DIR / "nccl_exports.txt")   # every export of NVIDIA's 2.30.7
    assert sorted(set(nccl_230) - set(names)) == [], "a program linked against NCCL 2.30 would not load"
    assert set(TORCH_2_11) <= set(names)
    done = subprocess.run([PY, "-c", "import ctypes; lib = ctypes.CDLL('libnccl.so.2'); "
                           "print(lib.ncclCommRegister(None, None, 0, None), lib.ncclCommRegister(None, None, 0, None))"],
                          env=client_env(native_libs, ""), capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["5", "5"], done.stdout + done.stderr   # ncclInvalidUsage
    assert done.stderr.splitlines() == [
        "rgpu: nccl: ncclCommRegister is not supported by rgpu's NCCL yet (rgpu remotes communicators from "
        "ncclGetUniqueId, their splits and shrinks, groups, all-reduce, broadcast, reduce, all-gather, reduce-scatter, "
        "all-to-all, send and receive, PreMulSum operators, ncclMemAlloc and ncclMemFree)"]


@pytest.mark.parametrize(("nranks", "dispatchers"), [(2, 1), (4, 2)])
def test_pytorchs_calls_split_premulsum_alltoall_nonblocking_init_and_finalize_equal_numpys(
        nccl_ranks: Path, native_libs: build.Libraries, tmp_path: Path, nranks: int, dispatchers: int) -> None:
    """What ProcessGroupNCCL adds to the collectives: a non-blocking ncclCommInitRankConfig polled with
    ncclCommGetAsyncError, PreMulSum operators (a host scalar and a device one), ncclAlltoAll,
    ncclCommSplit (by color, ordered by key; NCCL_SPLIT_NOCOLOR gives NULL), ncclCommFinalize then
    ncclCommDestroy."""
    with ExitStack() as stack:
        procs = _rank_processes(native_libs, nccl_ranks, _servers(stack, dispatchers), nranks, tmp_path,
                                ["more", "{rank}", str(nranks), str(tmp_path / "id"), str(COUNT),
                                 str(tmp_path / "out.{rank}")])
        outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and out.splitlines()[-1] == "OK", f"rank {rank}: {out}{err}"
        same_color = sorted((r for r in range(nranks) if r % 2 == rank % 2), key=lambda r: nranks - r)
        assert out.splitlines()[0] == f"split {same_color.index(rank)} of {len(same_color)}", out
        data, at = (tmp_path / f"out.{rank}").read_bytes(), 0
        for name, want in _expected_more(rank, nranks):
            got = np.frombuffer(data, dtype=want.dtype, count=want.size, offset=at)
            at += want.nbytes
            assert np.array_equal(got, want), f"rank {rank} of {nranks}: {name} differs from numpy's"
        assert at == len(data)


def test_the_real_gpu_workers_split_premulsum_alltoall_and_finalize_run_chained_to_emulated_workers(
        nccl_ranks: Path, native_libs: build.Libraries, chained: Server, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """backends/nccl_cuda.py's ncclCommSplit thread, PreMulSum (host and device scalars), all-to-all and
    finalize, through "cuda" workers whose NCCL is rgpu's own libnccl.so.2 (as above)."""
    monkeypatch.setenv("RGPU_NCCL_LIBRARY", str(native_libs.libnccl))
    monkeypatch.setenv("RGPU_LOG", "warn")
    procs = _rank_processes(native_libs, nccl_ranks, [chained], 2, tmp_path,
                            ["more", "{rank}", "2", str(tmp_path / "id"), str(COUNT), str(tmp_path / "out.{rank}")])
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and out.splitlines() == ["split 0 of 1", "OK"], f"rank {rank}: {out}{err}"
        data, at = (tmp_path / f"out.{rank}").read_bytes(), 0
        for name, want in _expected_more(rank, 2):
            got = np.frombuffer(data, dtype=want.dtype, count=want.size, offset=at)
            at += want.nbytes
            assert np.array_equal(got, want), f"rank {rank}: {name} differs from numpy's"


def _check_scale(procs: list[subprocess.Popen[str]], tmp_path: Path, nranks: int) -> None:
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and out.splitlines() == _scale_lines(rank, nranks), f"rank {rank}: {out}{err}"
        _check_outputs(tmp_path / f"out.{rank}", _expected_scale(rank, nranks), f"rank {rank} of {nranks}")


@pytest.mark.parametrize(("nranks", "dispatchers"), [(2, 1), (4, 1), (4, 2)])
def test_a_scalable_init_and_shrinks_that_leave_ranks_out_equal_numpys(
        nccl_ranks: Path, native_libs: build.Libraries, tmp_path: Path, nranks: int, dispatchers: int) -> None:
    """ncclCommInitRankScalable with two ids made by two ranks, then ncclCommShrink called only by the ranks
    that stay (rank 0 is left out; with 4 ranks the shrunk communicator is shrunk again, non-blocking):
    the new ranks follow the parent's order and the collectives on each equal numpy's."""
    with ExitStack() as stack:
        procs = _rank_processes(native_libs, nccl_ranks, _servers(stack, dispatchers), nranks, tmp_path,
                                ["scale", "{rank}", str(nranks), str(tmp_path / "id"), str(COUNT),
                                 str(tmp_path / "out.{rank}")])
        _check_scale(procs, tmp_path, nranks)


def test_a_shrink_that_names_the_calling_rank_or_a_rank_outside_is_refused_in_one_line(
        nccl_ranks: Path, native_libs: build.Libraries, tmp_path: Path) -> None:
    """The client refuses a rank that excludes itself; the worker a list with a rank outside the parent."""
    with ExitStack() as stack:
        procs = _rank_processes(native_libs, nccl_ranks, _servers(stack, 1), 2, tmp_path,
                                ["badshrink", "{rank}", "2", str(tmp_path / "id")])
        outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}: {out}{err}"
        assert out.splitlines() == ["self 4 outside 4"], f"rank {rank}: {out}{err}"
        assert "this rank is in excludeRanksList (excluded ranks do not call it)" in err, err
        assert "excludeRanksList [5] names a rank outside 0..1" in err, err


def test_the_real_gpu_workers_scalable_init_and_shrink_run_chained_to_emulated_workers(
        nccl_ranks: Path, native_libs: build.Libraries, chained: Server, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """backends/nccl_cuda.py's ncclCommInitRankScalable (every id) and ncclCommShrink threads, through
    "cuda" workers whose NCCL is rgpu's own libnccl.so.2 (as above)."""
    monkeypatch.setenv("RGPU_NCCL_LIBRARY", str(native_libs.libnccl))
    monkeypatch.setenv("RGPU_LOG", "warn")
    procs = _rank_processes(native_libs, nccl_ranks, [chained], 2, tmp_path,
                            ["scale", "{rank}", "2", str(tmp_path / "id"), str(COUNT), str(tmp_path / "out.{rank}")])
    _check_scale(procs, tmp_path, 2)


def _two_slice_conf(server: Server, path: Path) -> Path:
    return conf_for(server, path, *(server.token(memory_limit=256 << 20, gpu=server.gpus[i], job_key="two-tasks")
                                    for i in range(2)))


def _ranks_through_flexrun(binary: Path, libs: build.Libraries, tmp_path: Path, flexrun_args: list[str],
                           rank_env: str) -> list[subprocess.CompletedProcess[str]]:
    def rank(r: int) -> subprocess.CompletedProcess[str]:
        return run_flexrun([*flexrun_args, "--", str(binary), "rank", str(r), "2", str(tmp_path / "id"), str(COUNT),
                            str(tmp_path / f"out.{r}")], libs, env_extra={rank_env: str(r)}, timeout=120)
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(rank, range(2)))


def test_tasks_that_see_every_slice_each_use_device_local_rank(nccl_ranks: Path, native_libs: build.Libraries,
                                                               emulated: Server, tmp_path: Path) -> None:
    """`flexrun -n 2 -- torchrun --nproc_per_node 2 train.py`: each process sees both slices and PyTorch
    picks device LOCAL_RANK; each rank's communicator is on its own slice (nccl_ranks checks
    ncclCommCuDevice == LOCAL_RANK), with sessions from both processes on each slice."""
    conf = _two_slice_conf(emulated, tmp_path / "adaptor.conf")
    done = _ranks_through_flexrun(nccl_ranks, native_libs, tmp_path, ["-f", str(conf)], "LOCAL_RANK")
    for r, d in enumerate(done):
        assert d.returncode == 0 and d.stdout.strip() == "OK", f"rank {r}: {d.stdout}{d.stderr}"
        _check(tmp_path / f"out.{r}", r, 2)


def test_srun_tasks_with_per_task_each_get_their_own_slice_as_device_0(nccl_ranks: Path, native_libs: build.Libraries,
                                                                       emulated: Server, tmp_path: Path) -> None:
    """`srun -n 2 flexrun --per-task -- app`: task SLURM_LOCALID gets slice SLURM_LOCALID of the job's two,
    as its device 0 (nccl_ranks uses device 0 without LOCAL_RANK); the ranks' slices differ, so their
    communicators are on different GPUs, as NCCL requires."""
    conf = _two_slice_conf(emulated, tmp_path / "adaptor.conf")
    done = _ranks_through_flexrun(nccl_ranks, native_libs, tmp_path, ["--per-task", "-f", str(conf)], "SLURM_LOCALID")
    for r, d in enumerate(done):
        assert d.returncode == 0 and d.stdout.strip() == "OK", f"rank {r}: {d.stdout}{d.stderr}"
        _check(tmp_path / f"out.{r}", r, 2)
    slices = flexrun.slices_from_conf(conf)
    for r in range(2):   # what each task's application was given
        seen = run_flexrun(["--per-task", "-f", str(conf), "--", PY, "-c", "import os; print(os.environ['RGPU_SLICES'])"],
                           native_libs, env_extra={"SLURM_LOCALID": str(r)})
        assert seen.returncode == 0 and seen.stdout.strip() == f"{slices[r].server},{slices[r].token}", seen.stderr


def test_per_task_says_in_one_line_when_a_task_has_no_slice_of_its_own(native_libs: build.Libraries,
                                                                       emulated: Server, tmp_path: Path) -> None:
    conf = _two_slice_conf(emulated, tmp_path / "adaptor.conf")
    done = run_flexrun(["--per-task", "-f", str(conf), "--", "true"], native_libs, env_extra={"SLURM_LOCALID": "2"})
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "rgpu: flexrun: task 2 on this node has no slice of its own (--per-task) (the job has 2 slices on this node; "
        "ask for as many slices as tasks per node (--gres=rgpu:N with --ntasks-per-node=N), or run without --per-task "
        "so every task sees every slice and picks one (LOCAL_RANK))"], done.stderr
    done = run_flexrun(["--per-task", "-f", str(conf), "--", "true"], native_libs)
    assert done.returncode == 2 and "--per-task needs SLURM_LOCALID" in done.stderr, done.stderr
    done = run_flexrun(["--per-task", "-n", "2", "--", "true"], native_libs)
    assert done.returncode == 2 and "--per-task takes the task's slice of the job's slices" in done.stderr, done.stderr


def test_nccl_mem_alloc_gives_device_memory_of_the_slice_and_free_gives_it_back(native_libs: build.Libraries,
                                                                              emulated: Server) -> None:
    """ncclMemAlloc (issue 27's list; NCCL's registered-buffer allocator) gives device memory of the
    calling thread's slice, counted against its limit, that copies and collectives can use; ncclMemFree
    gives it back. A size the slice cannot hold fails with ncclUnhandledCudaError and one line."""
    program = """
import ctypes
cuda, nccl = ctypes.CDLL("libcuda.so.1"), ctypes.CDLL("libnccl.so.2")
assert cuda.cuInit(0) == 0
free0, free1, total = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
ptr, none = ctypes.c_void_p(), ctypes.c_void_p(1)
print("ALLOC", nccl.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(8 << 20)), ptr.value is not None)
cuda.cuMemGetInfo_v2(ctypes.byref(free1), ctypes.byref(total))
print("SIZE0", nccl.ncclMemAlloc(ctypes.byref(none), ctypes.c_size_t(0)), none.value)
print("MEMSET", cuda.cuMemsetD8_v2(ctypes.c_uint64(ptr.value), 7, ctypes.c_size_t(8 << 20)))
back = (ctypes.c_uint8 * 16)()
print("COPY", cuda.cuMemcpyDtoH_v2(back, ctypes.c_uint64(ptr.value + (4 << 20)), ctypes.c_size_t(16)), list(back)[:3])
print("FREE", nccl.ncclMemFree(ptr), nccl.ncclMemFree(None))
cuda.cuMemGetInfo_v2(ctypes.byref(free0), ctypes.byref(total))
print("RETURNED", free0.value - free1.value >= 8 << 20)
huge = ctypes.c_void_p()
print("HUGE", nccl.ncclMemAlloc(ctypes.byref(huge), ctypes.c_size_t(1 << 40)), huge.value)
print("NULL", nccl.ncclMemAlloc(None, ctypes.c_size_t(16)))
"""
    done = subprocess.run([PY, "-c", program], env=client_env(native_libs, emulated.slices(emulated.token())),
                          capture_output=True, text=True, timeout=60)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, out + err
    assert "ALLOC 0 True" in out and "SIZE0 0 None" in out, out + err
    assert "MEMSET 0" in out and "COPY 0 [7, 7, 7]" in out and "FREE 0 0" in out and "RETURNED True" in out, out + err
    assert "HUGE 1 None" in out and "NULL 4" in out, out + err     # ncclUnhandledCudaError, ncclInvalidArgument
    assert "ncclMemAlloc: 1099511627776 bytes of device memory: CUDA error 2 (out of memory" in err, err
