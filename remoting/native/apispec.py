"""Parse the reviewed API specs (spec/cuda.spec, spec/nvml.spec, spec/nccl.spec) into typed records.

Pure: reads text, returns dataclasses; the generator and the tests share it. The spec format is
described at the top of spec/cuda.spec.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

SPEC_DIR = Path(__file__).parent / "spec"
MODES = ("sync", "async", "manual", "local", "unsupported")
FIRST_OPCODE = 32  # 0-31: session control frames (protocol.py)


@dataclass(frozen=True)
class WireType:
    """How one C type travels: a struct format character (or a kind) and its Python/ctypes view."""

    c: str            # C spelling in generated code
    fmt: str          # struct format ("i", "Q", "16s"); "" for variable-length kinds
    kind: str         # "int" | "float" | "handle" | "ctx" | "dev" | "bytes" | "str" | "nvmldev" | "ncclcomm" | "devptr"
    ctypes: str       # ctypes type used by the server's driver calls


def _enum(c: str) -> WireType:
    return WireType(c, "i", "int", "ctypes.c_int")


def _handle(c: str) -> WireType:
    return WireType(c, "Q", "handle", "ctypes.c_void_p")


TYPES: dict[str, WireType] = {
    "int": WireType("int", "i", "int", "ctypes.c_int"),
    "unsigned int": WireType("unsigned int", "I", "int", "ctypes.c_uint"),
    "unsigned char": WireType("unsigned char", "B", "int", "ctypes.c_ubyte"),
    "unsigned short": WireType("unsigned short", "H", "int", "ctypes.c_ushort"),
    "size_t": WireType("size_t", "Q", "int", "ctypes.c_size_t"),
    "unsigned long long": WireType("unsigned long long", "Q", "int", "ctypes.c_ulonglong"),
    "cuuint64_t": WireType("cuuint64_t", "Q", "int", "ctypes.c_uint64"),
    "float": WireType("float", "f", "float", "ctypes.c_float"),
    "CUdeviceptr": WireType("CUdeviceptr", "Q", "int", "ctypes.c_uint64"),
    "CUdevice": WireType("CUdevice", "i", "dev", "ctypes.c_int"),
    "CUcontext": WireType("CUcontext", "Q", "ctx", "ctypes.c_void_p"),
    "CUuuid": WireType("CUuuid", "16s", "bytes", "ctypes.c_char * 16"),
    "char": WireType("char", "", "bytes", "ctypes.c_char"),
    "CUmemGenericAllocationHandle": WireType("CUmemGenericAllocationHandle", "Q", "int", "ctypes.c_ulonglong"),
    "cuuint32_t": WireType("cuuint32_t", "I", "int", "ctypes.c_uint32"),
    "CUtexObject": WireType("CUtexObject", "Q", "int", "ctypes.c_ulonglong"),
    "CUsurfObject": WireType("CUsurfObject", "Q", "int", "ctypes.c_ulonglong"),
    # NVML
    "nvmlDevice_t": WireType("nvmlDevice_t", "I", "nvmldev", "ctypes.c_void_p"),
    "nvmlReturn_t": _enum("nvmlReturn_t"),
    # NCCL: a communicator is a client object (its slice and the worker's communicator), buffers are
    # the slice's device addresses, the stream is the client's handle (the worker maps it)
    "ncclComm_t": WireType("ncclComm_t", "Q", "ncclcomm", "ctypes.c_void_p"),
    "void": WireType("void", "Q", "devptr", "ctypes.c_void_p"),
    "cudaStream_t": _handle("cudaStream_t"),
    "ncclUniqueId": WireType("ncclUniqueId", "128s", "bytes", "ctypes.c_char * 128"),
}
# NVML structs travel as raw bytes: both ends share the C layout (x86-64 and aarch64 alike).
for _name, _size in (("nvmlMemory_t", 24), ("nvmlMemory_v2_t", 40), ("nvmlBAR1Memory_t", 24),
                     ("nvmlPciInfo_t", 68), ("nvmlPciInfoExt_t", 64), ("nvmlUtilization_t", 8),
                     # CUDA structs with no host pointers that matter on the server
                     ("CUgraphExecUpdateResultInfo", 24), ("CUlaunchAttributeValue", 64),
                     ("CUmemAllocationProp", 32), ("CUmemLocation", 8),
                     # arrays, texture and surface objects: handles and device pointers in them are
                     # the worker's values, so the structs travel as they are (CUDA 13 layouts)
                     ("CUDA_ARRAY_DESCRIPTOR", 24), ("CUDA_ARRAY3D_DESCRIPTOR", 40),
                     ("CUDA_ARRAY_MEMORY_REQUIREMENTS", 32), ("CUDA_ARRAY_SPARSE_PROPERTIES", 48),
                     ("CUDA_RESOURCE_DESC", 144), ("CUDA_TEXTURE_DESC", 104), ("CUDA_RESOURCE_VIEW_DESC", 112)):
    TYPES[_name] = WireType(_name, f"{_size}s", "bytes", f"ctypes.c_char * {_size}")
for _name in ("CUstream", "CUevent", "CUmodule", "CUfunction", "CUlibrary", "CUkernel",
              "CUmemoryPool", "CUlinkState", "CUgraph", "CUgraphExec", "CUgraphNode", "CUarray",
              "CUmipmappedArray", "CUtexref", "CUsurfref"):
    TYPES[_name] = _handle(_name)
for _name in ("CUresult", "CUdevice_attribute", "CUarray_format", "CUexecAffinityType",
              "CUflushGPUDirectRDMAWritesTarget", "CUflushGPUDirectRDMAWritesScope", "CUlimit",
              "CUfunc_cache", "CUsharedconfig", "CUmemPool_attribute", "CUpointer_attribute",
              "CUstreamCaptureStatus", "CUstreamCaptureMode", "CUjit_option", "CUjitInputType",
              "CUmoduleLoadingMode", "CUfunction_attribute", "CUfunctionLoadingState",
              "CUgraphMem_attribute", "CUgraphNodeType", "CUstreamAttrID", "CUmemAllocationGranularity_flags",
              "nvmlTemperatureSensors_t", "nvmlClockType_t", "nvmlClockId_t", "nvmlPstates_t",
              "nvmlEnableState_t", "nvmlComputeMode_t", "nvmlBrandType_t", "nvmlMemoryErrorType_t",
              "nvmlEccCounterType_t", "nvmlTemperatureThresholds_t", "nvmlDeviceArchitecture_t",
              "nvmlPcieUtilCounter_t", "nvmlInforomObject_t", "nvmlGpuOperationMode_t",
              "ncclResult_t", "ncclDataType_t", "ncclRedOp_t"):
    TYPES[_name] = _enum(_name)


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str                  # base C type, e.g. "CUstream", "char"
    direction: str              # "in" | "out" | "out?" | "inout"
    pointer: bool               # declared with '*'
    length: str = ""            # array length: a parameter name or a number
    const: bool = False
    raw: str = ""               # the declaration as written

    @property
    def wire(self) -> WireType | None:
        return TYPES.get(self.ctype)

    @property
    def known_wire(self) -> WireType:
        """`wire` where the spec's checks (load) have made sure there is one: the generator's view."""
        w = TYPES.get(self.ctype)
        if w is None:
            raise ValueError(f"rgpu: apispec: parameter {self.name} has C type {self.ctype!r} with no wire type")
        return w

    @property
    def is_output(self) -> bool:
        return self.direction in ("out", "out?", "inout")

    @property
    def is_string(self) -> bool:
        return self.ctype == "char" and self.pointer and self.const and self.direction == "in"

    @property
    def c_decl(self) -> str:
        """The parameter as a C declaration (arrays become pointers)."""
        text = ("const " if self.const else "") + self.ctype
        if self.pointer or self.length:
            text += " *"
            if self.raw.count("*") > 1:
                text += "*" * (self.raw.count("*") - 1)
        else:
            text += " "
        return text + self.name


@dataclass(frozen=True)
class Function:
    mode: str
    name: str
    params: tuple[Param, ...]
    comment: str = ""
    opcode: int = 0
    line: int = 0

    @property
    def inputs(self) -> list[Param]:
        return [p for p in self.params if p.direction in ("in", "inout")]

    @property
    def outputs(self) -> list[Param]:
        return [p for p in self.params if p.is_output]

    @property
    def route(self) -> Param | None:
        """The input that picks the session: the first CUdevice, CUcontext, nvmlDevice_t or ncclComm_t."""
        for p in self.params:
            if p.direction == "in" and not p.pointer and p.wire and p.wire.kind in ("dev", "ctx", "nvmldev", "ncclcomm"):
                return p
        return None

    @property
    def c_params(self) -> str:
        return ", ".join(p.c_decl for p in self.params) or "void"

    @property
    def c_args(self) -> str:
        return ", ".join(p.name for p in self.params)


@dataclass
class Spec:
    path: Path
    protocol_version: int
    functions: list[Function] = field(default_factory=list)
    sha256: str = ""

    def by_name(self, name: str) -> Function:
        for f in self.functions:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def wire_functions(self) -> list[Function]:
        return [f for f in self.functions if f.opcode]


class SpecError(ValueError):
    pass


_LINE_RE = re.compile(r"^(?P<mode>\w+)\s+(?P<name>\w+)\s*\((?P<params>[^)]*)\)\s*(?:#\s*(?P<comment>.*))?$")
_PARAM_RE = re.compile(
    r"^(?P<dir>out\?|out|inout)?\s*(?P<const>const\s+)?(?P<type>(?:unsigned\s+)?(?:long\s+long|\w+))"
    r"\s*(?P<stars>\**)\s*(?P<name>\w+)\s*(?:\[(?P<len>\w+)\])?$")


def parse_param(text: str, where: str) -> Param:
    m = _PARAM_RE.match(text.strip())
    if not m:
        raise SpecError(f"{where}: cannot parse parameter {text!r}")
    direction = m.group("dir") or "in"
    ctype = " ".join(m.group("type").split())
    stars = m.group("stars")
    if direction != "in" and not stars and not m.group("len"):
        raise SpecError(f"{where}: output parameter {m.group('name')} must be a pointer or an array")
    return Param(name=m.group("name"), ctype=ctype, direction=direction, pointer=bool(stars),
                 length=m.group("len") or "", const=bool(m.group("const")), raw=text.strip())


def parse_spec(path: Path, first_opcode: int = FIRST_OPCODE) -> Spec:
    text = path.read_text(encoding="utf-8")
    version = None
    functions: list[Function] = []
    opcode = first_opcode
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path.name}:{lineno}"
        if line.startswith("protocol_version"):
            version = int(line.split()[1])
            continue
        m = _LINE_RE.match(line)
        if not m:
            raise SpecError(f"{where}: cannot parse {line!r}")
        mode, name = m.group("mode"), m.group("name")
        if mode not in MODES:
            raise SpecError(f"{where}: unknown mode {mode!r} (one of {', '.join(MODES)})")
        if name in seen:
            raise SpecError(f"{where}: {name} is listed twice")
        seen.add(name)
        params_text = m.group("params").strip()
        params = tuple(parse_param(p, where) for p in params_text.split(",")) if params_text else ()
        if mode in ("sync", "async"):
            for p in params:
                if p.is_string or p.length:
                    continue
                device_buffer = p.wire is not None and p.wire.kind == "devptr" and p.pointer
                if p.wire is None or (p.pointer and p.direction == "in" and not p.const and not device_buffer):
                    raise SpecError(f"{where}: {name}: parameter {p.raw!r} cannot be generated; "
                                    "mark the function manual or local")
            if mode == "async" and any(p.is_output for p in params):
                raise SpecError(f"{where}: {name} is async but has outputs")
        op = 0
        if mode in ("sync", "async", "manual"):
            op = opcode
            opcode += 1
        functions.append(Function(mode=mode, name=name, params=params,
                                  comment=(m.group("comment") or "").strip(), opcode=op, line=lineno))
    if version is None:
        raise SpecError(f"{path.name}: no protocol_version line")
    # The fingerprint covers what crosses the wire (opcodes and parameters of the remoted
    # functions), so a `local` or `unsupported` entry, which never reaches the server, needs no
    # version bump.
    wire = "\n".join(f"{f.opcode} {f.mode} {f.name}({', '.join(p.raw for p in f.params)})"
                     for f in functions if f.mode in ("sync", "async", "manual"))
    digest = hashlib.sha256(f"{version}\n{wire}".encode()).hexdigest()
    return Spec(path=path, protocol_version=version, functions=functions, sha256=digest)


def read_exports(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def read_procs(path: Path) -> list[tuple[str, int, str]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            base, ver, sym = line.split()
            rows.append((base, int(ver), sym))
    return rows


def read_enums(path: Path) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            typename, name, value = line.split()
            out.setdefault(typename, {})[name] = int(value)
    return out
