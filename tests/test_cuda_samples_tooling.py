"""The cuda-samples tooling's pure parts (benchmarks/cuda_samples): the sample list, build plans
read from CMakeLists.txt text, nvcc command lines, and the comparison of local and rgpu runs.
No GPU, no nvcc and no cuda-samples checkout needed: the CMake texts below are cut down from
NVIDIA/cuda-samples (revision c94ff366)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.cuda_samples import build, run
from benchmarks.cuda_samples.outcomes import (
    WAIVE_CODE,
    Run,
    failure_lines,
    is_waived,
    last_line,
    refused_recovering,
    should_retry,
    summarize,
    table,
    to_json,
    verdict,
    waived_lines,
)
from benchmarks.cuda_samples.plan import (
    PlanError,
    Toolchain,
    compile_command,
    gencode,
    image_command,
    link_name,
    parse_sample_list,
    pin_nvjitlink,
    plan_sample,
    python_examples,
    select,
)

REPO = Path(__file__).resolve().parent.parent
SAMPLES_TXT = REPO / "benchmarks" / "cuda_samples" / "SAMPLES.txt"

VECTOR_ADD = """
# comment naming CUDA::npp must not count
add_executable(vectorAdd vectorAdd.cu)
target_compile_options(vectorAdd PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--extended-lambda>)
"""

MATRIX_MUL_DRV = """
add_executable(matrixMulDrv matrixMulDrv.cpp)
target_compile_options(matrixMulDrv PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--extended-lambda>)
target_link_libraries(matrixMulDrv PUBLIC CUDA::cuda_driver)
set(CUDA_FATBIN_FILE "${CMAKE_CURRENT_BINARY_DIR}/matrixMul_kernel64.fatbin")
set(CUDA_KERNEL_SOURCE "${CMAKE_CURRENT_SOURCE_DIR}/matrixMul_kernel.cu")
"""

CUSOLVER = """
add_executable(cuSolverSp_LowlevelQR cuSolverSp_LowlevelQR.cpp mmio.c mmio_wrapper.cpp)
target_link_libraries(cuSolverSp_LowlevelQR PRIVATE CUDA::cudart CUDA::cusolver CUDA::cublas)
add_custom_command(TARGET cuSolverSp_LowlevelQR POST_BUILD
    COMMAND ${CMAKE_COMMAND} -E copy_if_different
    ${CMAKE_CURRENT_SOURCE_DIR}/lap2D_5pt_n32.mtx ${CMAKE_CURRENT_SOURCE_DIR}/lap3D_7pt_n20.mtx
    ${CMAKE_CURRENT_BINARY_DIR})
"""

NVRTC = """
add_executable(clock_nvrtc clock.cpp)
target_link_libraries(clock_nvrtc PRIVATE CUDA::nvrtc CUDA::cuda_driver)
add_custom_command(TARGET clock_nvrtc POST_BUILD
    COMMAND ${CMAKE_COMMAND} -E copy ${CMAKE_CURRENT_SOURCE_DIR}/clock_kernel.cu ${CMAKE_CURRENT_BINARY_DIR})
"""

MC = """
add_executable(MC_EstimatePiP src/main.cpp src/piestimator.cu src/test.cpp)
set_target_properties(MC_EstimatePiP PROPERTIES CUDA_SEPARABLE_COMPILATION ON)
target_link_libraries(MC_EstimatePiP PRIVATE CUDA::curand)
"""

# -------------------------------------------------------------------------------- the sample list


def test_shipped_sample_list_has_the_93_verified_samples() -> None:
    entries = parse_sample_list(SAMPLES_TXT.read_text())
    assert len(entries) == 93
    names = [e.split("/")[1] for e in entries]
    assert len(set(names)) == 93
    assert {"vectorAdd", "simpleCUBLAS", "jitLto", "matrixMul_nvrtc", "cuSolverRf"} <= set(names)
    assert entries[0] == "0_Introduction/asyncAPI"


def test_sample_list_skips_comments_and_blank_lines() -> None:
    text = "# header\n\n0_Introduction/clock   # why\n  4_CUDA_Libraries/simpleCUBLAS\n"
    assert parse_sample_list(text) == ["0_Introduction/clock", "4_CUDA_Libraries/simpleCUBLAS"]


@pytest.mark.parametrize("bad", ["vectorAdd", "a/b/c", "../etc", "0_Introduction/vector Add", "x/.."])
def test_malformed_sample_list_line_is_named(bad: str) -> None:
    with pytest.raises(PlanError, match=r"line 2: .* is not `category/name`"):
        parse_sample_list(f"0_Introduction/clock\n{bad}\n")


def test_repeated_sample_is_refused() -> None:
    with pytest.raises(PlanError, match="line 2: clock is listed twice"):
        parse_sample_list("0_Introduction/clock\n9_Other/clock\n")


def test_select_keeps_list_order_and_names_unknown_samples() -> None:
    entries = ["a/one", "b/two", "c/three"]
    assert select(entries, ["three", "a/one"]) == ["a/one", "c/three"]
    with pytest.raises(PlanError, match="not in the sample list: nope"):
        select(entries, ["one", "nope"])


# -------------------------------------------------------------------------------- build plans

def test_runtime_sample_links_cudart_statically() -> None:
    plan = plan_sample("0_Introduction/vectorAdd", VECTOR_ADD, frozenset({"vectorAdd.cu", "README.md"}))
    assert (plan.name, plan.sources, plan.libraries, plan.cudart) == ("vectorAdd", ("vectorAdd.cu",), (), "static")
    assert plan.extended_lambda and not plan.rdc and plan.images == () and plan.data == ()


def test_driver_sample_gets_its_kernel_fatbin() -> None:
    files = frozenset({"matrixMulDrv.cpp", "matrixMul_kernel.cu", "matrixMul.h"})
    plan = plan_sample("0_Introduction/matrixMulDrv", MATRIX_MUL_DRV, files)
    [image] = plan.images
    assert (image.source, image.output, image.kind) == ("matrixMul_kernel.cu", "matrixMul_kernel64.fatbin", "fatbin")
    assert plan.data == ()      # the kernel source is compiled, not copied


def test_cusolver_sample_links_cublas_and_cusparse_and_copies_only_its_default_matrix() -> None:
    files = frozenset({"cuSolverSp_LowlevelQR.cpp", "mmio.c", "mmio_wrapper.cpp", "lap2D_5pt_n32.mtx", "lap3D_7pt_n20.mtx"})
    plan = plan_sample("4_CUDA_Libraries/cuSolverSp_LowlevelQR", CUSOLVER, files,
                       source_text='const char *name = "lap2D_5pt_n32.mtx";')
    assert plan.libraries == ("cusolver", "cublas", "cusparse")
    assert plan.cudart == "shared" and plan.uses_math_library
    assert plan.data == ("lap2D_5pt_n32.mtx",)


def test_nvrtc_sample_uses_the_driver_api_only_and_carries_its_kernel_source() -> None:
    plan = plan_sample("0_Introduction/clock_nvrtc", NVRTC, frozenset({"clock.cpp", "clock_kernel.cu"}), forced_cudart="shared")
    assert plan.cudart == "none" and plan.libraries == ("nvrtc",)
    assert plan.data == ("clock_kernel.cu",)


def test_forced_shared_cudart_applies_to_runtime_samples() -> None:
    assert plan_sample("0_Introduction/vectorAdd", VECTOR_ADD, frozenset({"vectorAdd.cu"}), forced_cudart="shared").cudart == "shared"


def test_unknown_cuda_library_is_refused_with_the_sample_named() -> None:
    cmake = "add_executable(boxFilterNPP main.cpp)\ntarget_link_libraries(boxFilterNPP CUDA::nppif)\n"
    with pytest.raises(PlanError, match=r"4_CUDA_Libraries/boxFilterNPP: links CUDA::nppif"):
        plan_sample("4_CUDA_Libraries/boxFilterNPP", cmake, frozenset({"main.cpp"}))


def test_missing_source_or_executable_is_refused() -> None:
    with pytest.raises(PlanError, match="names vectorAdd.cu, which the sample folder lacks"):
        plan_sample("0_Introduction/vectorAdd", VECTOR_ADD, frozenset())
    with pytest.raises(PlanError, match="expected one add_executable"):
        plan_sample("x/y", "project(y)\n", frozenset())


def test_compile_command_has_arch_rdc_include_and_rpaths() -> None:
    files = frozenset({"src/main.cpp", "src/piestimator.cu", "src/test.cpp", "inc/piestimator.h"})
    plan = plan_sample("2_Concepts_and_Techniques/MC_EstimatePiP", MC, files)
    tc = Toolchain(nvcc="nvcc", common_include=Path("/cs/Common"), arch="sm_90", link_dir=Path("/tmp/link"),
                   cuda_libs=Path("/w/cu13"), extra_include=Path("/tmp/link/include"), rpath="/opt/libs")
    cmd = compile_command(plan, tc, Path("/cs/Samples/2/MC"), Path("/out/MC_EstimatePiP/MC_EstimatePiP"))
    joined = " ".join(cmd)
    assert "-gencode arch=compute_90,code=[sm_90,compute_90]" in joined
    assert "-rdc=true" in cmd and "-I/cs/Samples/2/MC/inc" in cmd
    assert cmd.index("-I/tmp/link/include") < cmd.index("-I/w/cu13/include")    # the pinned header wins
    assert cmd[cmd.index("-cudart") + 1] == "shared"
    assert "-lcurand" in cmd and "-lcuda" in cmd and "-L/tmp/link" in cmd
    assert "-Xlinker=-rpath,/opt/libs" in cmd and "-Xlinker=-rpath,$ORIGIN/../cudart" in cmd
    assert "/cs/Samples/2/MC/src/piestimator.cu" in cmd


def test_ptx_image_is_compiled_for_one_arch() -> None:
    cmake = ('add_executable(ptxjit ptxjit.cpp)\ntarget_link_libraries(ptxjit PUBLIC CUDA::cuda_driver CUDA::cudart)\n'
             'set(CUDA_PTX_FILE "${CMAKE_CURRENT_BINARY_DIR}/ptxjit_kernel64.ptx")\n'
             'set(CUDA_KERNEL_SOURCE "${CMAKE_CURRENT_SOURCE_DIR}/ptxjit_kernel.cu")\n')
    plan = plan_sample("3_CUDA_Features/ptxjit", cmake, frozenset({"ptxjit.cpp", "ptxjit_kernel.cu"}))
    tc = Toolchain(nvcc="nvcc", common_include=Path("/c"), arch="sm_90", link_dir=Path("/l"))
    cmd = image_command(plan.images[0], tc, Path("/s"), Path("/o"))
    assert cmd == ["nvcc", "-I/c", "-arch=sm_90", "-ptx", "-o", "/o/ptxjit_kernel64.ptx", "/s/ptxjit_kernel.cu"]


@pytest.mark.parametrize("arch", ["90", "sm90", "compute_90", "sm_90; rm -rf /"])
def test_bad_arch_is_one_line_error(arch: str) -> None:
    with pytest.raises(PlanError, match="is not of the form sm_90"):
        gencode(arch)


def test_nvjitlink_header_is_pinned_to_the_older_entry_points() -> None:
    header = ("extern nvJitLinkResult __nvJitLinkCreate_13_5(nvJitLinkHandle *h);\n"
              "static inline nvJitLinkResult nvJitLinkCreate(nvJitLinkHandle *h) { return __nvJitLinkCreate_13_5 (h); }\n"
              "#define NVJITLINK_VERSION_13_5 1\n")
    pinned = pin_nvjitlink(header, "13_0")
    assert "__nvJitLinkCreate_13_0(" in pinned and "__nvJitLinkCreate_13_0 (h)" in pinned
    assert "_13_5" in pinned.splitlines()[2]       # only the entry points change
    with pytest.raises(PlanError):
        pin_nvjitlink(header, "13.0")


@pytest.mark.parametrize("filename,expected", [("libcublas.so.13", "libcublas.so"), ("libcublasLt.so.13.1.0", "libcublasLt.so"),
                                               ("libnvrtc-builtins.so.13.5", "libnvrtc-builtins.so"), ("libcufft.so", None),
                                               ("README", None)])
def test_link_name(filename: str, expected: str | None) -> None:
    assert link_name(filename) == expected


def test_build_help_and_defaults_need_no_gpu() -> None:
    args = build.parser().parse_args(["--source", "/cs", "--out", "/o"])
    assert (args.arch, args.cudart, args.nvjitlink_abi, args.cuda_libs) == ("sm_90", "auto", "13_0", None)
    with pytest.raises(SystemExit) as done:
        build.main(["--help"])
    assert done.value.code == 0


def test_build_names_a_missing_source_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert build.main(["--source", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "is not a cuda-samples checkout" in capsys.readouterr().err


# -------------------------------------------------------------------------------- comparing runs

def ok(name: str, mode: str = "rgpu") -> Run:
    return Run(name, mode, 0, 1.0)


def failed(name: str, mode: str = "rgpu", rc: int | None = 1, line: str = "boom", timed_out: bool = False) -> Run:
    return Run(name, mode, rc, 2.0, line, timed_out)


def test_recovering_refusal_is_recognised_as_the_session_server_writes_it() -> None:
    source = (REPO / "remoting" / "dispatcher" / "session_accept.py").read_text()
    assert 'f"rgpu: session: GPU {gpu.index} ({gpu.uuid}) of {self.advertised} is recovering "' in source
    assert '"from a GPU fault' in source
    # The client library writes the refusal with the server and device appended.
    stderr = ("some output\nrgpu: session: GPU 0 (GPU-8f1c2d) of 127.0.0.1:40123 is recovering from a GPU fault that ended "
              "the sessions sharing it under MPS (retry in a few seconds) [server 127.0.0.1:40123, device 0]\n"
              "CUDA error at vectorAdd.cu:80 code=46\n")
    assert refused_recovering(stderr)
    assert not refused_recovering("rgpu: session: the lease of job 7 (slice 0) was released or reclaimed by the pool")
    assert should_retry(stderr, waited=3.0, limit=10.0)
    assert not should_retry(stderr, waited=10.0, limit=10.0)
    assert not should_retry("CUDA error: an illegal memory access was encountered", waited=0.0, limit=10.0)


def test_last_line_prefers_stderr_then_stdout() -> None:
    assert last_line("a\nlast error\n\n", "out") == "last error"
    assert last_line("", "x\nTest passed\n") == "Test passed"
    assert last_line("", "") == ""


def test_verdicts() -> None:
    assert verdict(ok("a", "local"), ok("a")) == "pass"
    assert verdict(ok("a", "local"), failed("a")) == "rgpu-fail"
    assert verdict(failed("a", "local"), ok("a")) == "local-fail"
    assert verdict(None, ok("a")) == "pass"
    assert verdict(None, failed("a")) == "fail"
    assert verdict(ok("a", "local"), None) == "not-run"


def test_summary_counts_rgpu_passes_among_local_passes() -> None:
    names = ["a", "b", "c", "d"]
    local = {"a": ok("a", "local"), "b": ok("b", "local"), "c": ok("c", "local"), "d": failed("d", "local", line="no GPU")}
    remote = {"a": ok("a"), "b": failed("b", line="rgpu: call refused"), "c": failed("c", rc=None, timed_out=True), "d": ok("d")}
    s = summarize(names, local, remote)
    assert (s.local_passes, s.rgpu_passes) == (3, 1)
    assert s.line() == "local passes 3, also through rgpu 1 (33%)"
    assert s.failures == ["b", "c", "d"]        # rgpu failures first, then local ones
    lines = failure_lines(s, local, remote)
    assert lines == ["b [rgpu]: exit 1: rgpu: call refused", "c [rgpu]: timeout: boom", "d [local]: exit 1: no GPU"]
    rows = table(names, local, remote)
    assert len(rows) == 5 and "rgpu-fail" in rows[2] and "timeout" in rows[3]
    result = to_json(names, local, remote, s, gpu="H100")
    assert result["gpu"] == "H100" and result["summary"]["local_passes"] == 3
    assert [p["verdict"] for p in result["programs"]] == ["pass", "rgpu-fail", "rgpu-fail", "local-fail"]


def test_summary_without_local_runs() -> None:
    s = summarize(["a", "b"], {}, {"a": ok("a"), "b": failed("b")})
    assert (s.local_ran, s.rgpu_passes) == (False, 1)
    assert s.line() == "through rgpu 1 of 2 pass (50%) (no local runs)"


def test_retried_run_says_how_many_attempts() -> None:
    r = Run("a", "rgpu", 1, 1.0, "refused", attempts=3)
    s = summarize(["a"], {"a": ok("a", "local")}, {"a": r})
    assert failure_lines(s, {"a": ok("a", "local")}, {"a": r}) == ["a [rgpu]: exit 1, 3 attempts: refused"]


# -------------------------------------------------------------------------------- run.py's setup

def test_run_environment_puts_rgpu_first_and_drops_stray_rgpu_settings() -> None:
    base = {"PATH": "/bin", "LD_LIBRARY_PATH": "/usr/lib/x", "RGPU_SLICES": "stale", "RGPU_LOG": "debug"}
    local = run.program_env(base, ["/b/cudart", "/opt/libs", ""])
    assert local["LD_LIBRARY_PATH"] == "/b/cudart:/opt/libs:/usr/lib/x" and "RGPU_SLICES" not in local
    remote = run.program_env(base, ["/b/cudart"], native="/rgpu/lib", slices="127.0.0.1:1,tok")
    assert remote["LD_LIBRARY_PATH"] == "/rgpu/lib:/b/cudart:/usr/lib/x"
    assert remote["RGPU_SLICES"] == "127.0.0.1:1,tok" and "RGPU_LOG" not in remote
    assert run.library_path(["/a"], None) == "/a"


def test_run_choose_and_list(tmp_path: Path) -> None:
    with pytest.raises(run.RunError, match="no .*LIST"):
        run.read_list(tmp_path)
    (tmp_path / "LIST").write_text("clock\nvectorAdd\nsimpleCUBLAS\n")
    names = run.read_list(tmp_path)
    assert run.choose(names, "simpleCUBLAS, clock") == ["clock", "simpleCUBLAS"]
    assert run.choose(names, None) == names
    with pytest.raises(run.RunError, match="not in LIST .*: nope"):
        run.choose(names, "nope")
    assert run.default_libs(tmp_path) == []
    (tmp_path / "BUILD.json").write_text('{"rpath": "/opt/libs"}')
    assert run.default_libs(tmp_path) == ["/opt/libs"]


def test_run_help_needs_no_gpu() -> None:
    args = run.parser().parse_args(["--built", "/b"])
    assert (args.timeout, args.retry_s, args.only_rgpu, args.sharing, args.local_workers) == (None, 10.0, False, None, 4)
    with pytest.raises(SystemExit) as done:
        run.main(["--help"])
    assert done.value.code == 0


# -------------------------------------------------------------------------------- cuda-python's examples

# Paths as they are in NVIDIA/cuda-python's cuda_bindings/examples (old camelCase pytest wrappers,
# the old in-tree helpers and the package's helper copy among them).
EXAMPLE_PATHS = [
    "0_Introduction/clock_nvrtc.py", "0_Introduction/clock_nvrtc_test.py", "0_Introduction/simple_p2p.py",
    "0_Introduction/simpleP2P_test.py", "3_CUDA_Features/simple_cuda_graphs.py", "common/common.py",
    "common/helper_cuda.py", "common/__init__.py", "extra/jit_program.py", "extra/numba_emm_plugin.py",
    "conftest.py", "_example_helpers/common.py", "extra/__pycache__/x.py", "README.md", "pytest.ini",
    ".hidden/a.py", "extra/test_something.py",
]


def test_python_examples_are_the_scripts_outside_helpers_and_tests() -> None:
    assert python_examples(EXAMPLE_PATHS) == [
        ("clock_nvrtc", "0_Introduction/clock_nvrtc.py"), ("simple_p2p", "0_Introduction/simple_p2p.py"),
        ("simple_cuda_graphs", "3_CUDA_Features/simple_cuda_graphs.py"), ("jit_program", "extra/jit_program.py"),
        ("numba_emm_plugin", "extra/numba_emm_plugin.py")]
    assert python_examples([]) == []


def test_two_examples_with_one_name_are_refused() -> None:
    with pytest.raises(PlanError, match="a/x.py and b/x.py share the name x"):
        python_examples(["b/x.py", "a/x.py"])


def test_waiver_is_the_waive_code_without_a_traceback() -> None:
    assert WAIVE_CODE == 2
    assert is_waived(2, 2, "Two or more GPUs with Peer-to-Peer access capability are required\n")
    assert not is_waived(2, None, "waived")                 # cuda-samples binaries: no waive code given
    assert not is_waived(1, 2, "waived")
    assert not is_waived(None, 2, "")
    assert not is_waived(2, 2, "Traceback (most recent call last):\n  ...\nSystemExit")
    assert not is_waived(2, 2, "python3: can't open file '/x/y.py': [Errno 2] No such file or directory")


def waived(name: str, mode: str, line: str = "needs 2 GPUs") -> Run:
    return Run(name, mode, 2, 0.5, line, waived=True)


def test_waived_locally_is_neither_a_local_pass_nor_a_failure() -> None:
    names = ["a", "p2p", "b"]
    local = {"a": ok("a", "local"), "p2p": waived("p2p", "local"), "b": ok("b", "local")}
    remote = {"a": ok("a"), "p2p": waived("p2p", "rgpu"), "b": waived("b", "rgpu", "no managed memory")}
    assert verdict(local["p2p"], remote["p2p"]) == "local-waived"
    assert verdict(local["b"], remote["b"]) == "rgpu-fail"     # rgpu hid a capability the GPU has
    s = summarize(names, local, remote)
    assert (s.local_passes, s.rgpu_passes, s.failures, s.waived) == (2, 1, ["b"], ["p2p"])
    assert s.line() == "local passes 2, also through rgpu 1 (50%); waived locally 1"
    assert failure_lines(s, local, remote) == ["b [rgpu]: waived: no managed memory"]
    assert waived_lines(s, local, remote) == ["p2p [local]: needs 2 GPUs"]
    assert "waived" in table(names, local, remote)[2]
    result = to_json(names, local, remote, s)
    assert result["summary"]["waived"] == ["p2p"] and result["programs"][1]["local"]["waived"] is True


def test_waived_through_rgpu_without_local_runs() -> None:
    s = summarize(["a", "p2p"], {}, {"a": ok("a"), "p2p": waived("p2p", "rgpu")})
    assert verdict(None, waived("p2p", "rgpu")) == "waived"
    assert (s.failures, s.waived) == ([], ["p2p"])
    assert s.line() == "through rgpu 1 of 2 pass (50%) (no local runs); waived 1"


def make_examples(root: Path) -> None:
    for rel in ["0_Introduction/clock_nvrtc.py", "0_Introduction/simple_p2p.py", "common/helper_cuda.py",
                "0_Introduction/clock_nvrtc_test.py", "extra/jit_program.py"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("print('hi')\n")


def test_python_programs_run_each_script_in_its_folder_with_the_examples_on_pythonpath(tmp_path: Path) -> None:
    make_examples(tmp_path)
    progs = run.python_programs(tmp_path, "/py/bin/python3", None)
    assert [p.name for p in progs] == ["clock_nvrtc", "simple_p2p", "jit_program"]
    p2p = progs[1]
    assert p2p.argv == ["/py/bin/python3", str(tmp_path / "0_Introduction" / "simple_p2p.py")]
    assert p2p.cwd == tmp_path / "0_Introduction" and p2p.waive_code == WAIVE_CODE
    assert p2p.env["CUDA_BINDINGS_SKIP_EXAMPLE"] == "2" and p2p.env["PYTHONPATH"].split(":")[0] == str(tmp_path)
    assert run.example_env(tmp_path, "/site")["PYTHONPATH"] == f"{tmp_path}:/site"
    assert [p.name for p in run.python_programs(tmp_path, "py", "jit_program,clock_nvrtc")] == ["clock_nvrtc", "jit_program"]
    with pytest.raises(run.RunError, match="not in the examples under .*: nope"):
        run.python_programs(tmp_path, "py", "nope")
    with pytest.raises(run.RunError, match="no folder"):
        run.python_programs(tmp_path / "missing", "py", None)
    with pytest.raises(run.RunError, match="no example scripts"):
        run.python_programs(_empty(tmp_path), "py", None)


def _empty(root: Path) -> Path:
    (root / "empty").mkdir()
    return root / "empty"


def test_python_examples_dry_run_prints_the_plan_without_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_examples(tmp_path)
    assert run.main(["--python-examples", str(tmp_path), "--python", "py3", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"clock_nvrtc: cd {tmp_path}/0_Introduction && PYTHONPATH={tmp_path}")
    assert out[0].endswith(f"CUDA_BINDINGS_SKIP_EXAMPLE=2 py3 {tmp_path}/0_Introduction/clock_nvrtc.py")
    assert out[-1] == "3 programs; LD_LIBRARY_PATH first: (nothing added); timeout 180 s each"


def test_run_without_a_gpu_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        run.require_gpu()
    except run.RunError:
        pass
    else:
        pytest.skip("this machine has a GPU: the run would start")
    make_examples(tmp_path)
    assert run.main(["--python-examples", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run: no GPU 0 on this machine (") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_built_and_python_examples_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        run.parser().parse_args(["--built", "/b", "--python-examples", "/e"])
    with pytest.raises(SystemExit):
        run.parser().parse_args([])
