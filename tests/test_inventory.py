"""GPU inventory: static files, selection and limits from the environment, and (on a GPU machine) NVML.

Everything but the `gpu`-marked tests is pure parsing and runs without a GPU. This module imports no
grpc, so it also runs on the GPU machine, whose grpcio may be older than the generated code needs.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from rgpu import validate
from rgpu.errors import ConfigError, RgpuError
from rgpu.model import GpuInfo
from rgpu.remoting.dispatcher.inventory import (DEFAULT_PORT_RANGE, EnvValue, NodeSettings, NvmlInventory, StaticInventory,
                                     apply_memory_limit, cuda_version_string, parse_inventory, parse_memory_limit,
                                     read_node_settings, select_gpus, served_gpus)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GiB = 2**30

UUID_A = "GPU-11111111-2222-3333-4444-555555555555"
UUID_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
UUID_C = "GPU-0f0f0f0f-0000-4000-8000-000000000003"

VALID = f"""
format = 1
hostname = "node-7"
driver_version = "580.82.07"
cuda_version = "13.0"

[[gpu]]
uuid = "{UUID_A}"
index = 0
name = "NVIDIA H100 80GB HBM3"
memory = "80G"
compute_capability = "9.0"

[[gpu]]
uuid = "{UUID_B}"
index = 1
name = "NVIDIA H100 80GB HBM3"
memory = 85899345920
compute_capability = "9.0"

[[gpu]]
uuid = "{UUID_C}"
index = 2
name = "NVIDIA A100-SXM4-40GB"
memory = "40960M"
compute_capability = "8.0"
"""


def gpus() -> tuple[GpuInfo, ...]:
    return parse_inventory(VALID, "test.toml").gpus


def one_line_error(excinfo: pytest.ExceptionInfo[RgpuError]) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith("rgpu: dispatcher: "), message
    return message


# --- static inventory files ---------------------------------------------------------------------

def test_valid_inventory_parses() -> None:
    inv = parse_inventory(VALID, "test.toml")
    assert inv.static and inv.hostname == "node-7"
    assert (inv.driver_version, inv.cuda_version) == ("580.82.07", "13.0")
    assert [g.index for g in inv.gpus] == [0, 1, 2]
    assert inv.gpus[0].total_memory_bytes == 80 * GiB == inv.gpus[0].usable_memory_bytes
    assert inv.gpus[1].total_memory_bytes == 80 * GiB   # an integer is bytes
    assert inv.gpus[2].total_memory_bytes == 40 * GiB
    assert inv.gpus[2].compute_capability == "8.0"


@pytest.mark.parametrize("name", ["inventory-a.toml", "inventory-b.toml"])
def test_example_inventories_are_valid(name: str) -> None:
    inv = StaticInventory(EXAMPLES / name).read()
    assert len(inv.gpus) == 2 and inv.static
    assert all(g.name == "NVIDIA H100 80GB HBM3" and g.total_memory_bytes == 80 * GiB and g.compute_capability == "9.0"
               for g in inv.gpus)


def test_example_inventories_have_distinct_uuids() -> None:
    a = {g.uuid for g in StaticInventory(EXAMPLES / "inventory-a.toml").read().gpus}
    b = {g.uuid for g in StaticInventory(EXAMPLES / "inventory-b.toml").read().gpus}
    assert len(a) == len(b) == 2 and not a & b


def test_hostname_is_optional() -> None:
    assert parse_inventory(VALID.replace('hostname = "node-7"\n', "")).hostname is None


def _gpu_table(**fields: object) -> str:
    base: dict[str, object] = {"uuid": UUID_A, "index": 0, "name": "NVIDIA H200", "memory": "141G",
                               "compute_capability": "9.0"}
    base.update(fields)
    lines = []
    for key, value in base.items():
        if value is _DROP:
            continue
        lines.append(f"{key} = {value}" if isinstance(value, _Raw) else f"{key} = {_toml(value)}")
    return "[[gpu]]\n" + "\n".join(lines) + "\n"


class _Raw(str):
    """TOML written as is (to produce wrong types and broken syntax)."""


_DROP = object()


def _toml(value: object) -> str:
    # JSON string escapes (\n, \r, \u0000) are valid TOML basic-string escapes.
    return json.dumps(value) if isinstance(value, str) else str(value)


def _doc(*gpu_tables: str, top: str = 'driver_version = "580.82.07"\ncuda_version = "13.0"\n') -> str:
    return top + "\n" + "\n".join(gpu_tables)


@pytest.mark.parametrize("text, expected", [
    ("this is = = not toml", "is not valid TOML"),
    (_doc(_gpu_table(), top='driver_version = "580.82.07"\ncuda_version = "13.0"\ncolour = "red"\n'),
     "unknown keys in the top level: 'colour'"),
    (_doc(_gpu_table(colour="red")), "unknown keys in [[gpu]] number 1: 'colour'"),
    (_doc(top='driver_version = "580.82.07"\ncuda_version = "13.0"\n'), "describes no GPUs"),
    (_doc(_gpu_table(), top='cuda_version = "13.0"\n'), "has no driver_version"),
    (_doc(_gpu_table(), top='driver_version = "580"\ncuda_version = "13"\n'), "cuda_version '13' is not MAJOR.MINOR"),
    (_doc(_gpu_table(), top='format = 2\ndriver_version = "580"\ncuda_version = "13.0"\n'), "format 2 is not supported"),
    (_doc(_gpu_table(), top='format = true\ndriver_version = "580"\ncuda_version = "13.0"\n'), "format True"),
    (_doc(_gpu_table(), top='hostname = "a b"\ndriver_version = "580"\ncuda_version = "13.0"\n'), "is not a host name"),
    (_doc(_gpu_table(uuid=_DROP)), "[[gpu]] number 1 has no uuid"),
    (_doc(_gpu_table(uuid="not-a-uuid")), "uuid 'not-a-uuid' is not a GPU UUID"),
    (_doc(_gpu_table(index=-1)), "index -1 is out of range"),
    (_doc(_gpu_table(index=_Raw("true"))), "index = True is not an integer"),
    (_doc(_gpu_table(index="0")), "index = '0' is not an integer"),
    (_doc(_gpu_table(memory="lots")), "memory 'lots' is not a size"),
    (_doc(_gpu_table(memory=0)), "memory 0 is not a size"),
    (_doc(_gpu_table(memory=_Raw("80.5"))), "memory = 80.5 is not a string or an integer"),
    (_doc(_gpu_table(compute_capability=_Raw("9.0"))), "compute_capability = 9.0 is not a string"),
    (_doc(_gpu_table(compute_capability="sm_90")), "compute_capability 'sm_90' is not MAJOR.MINOR"),
    (_doc(_gpu_table(compute_capability="9.0\n")), "compute_capability '9.0\\n' is not MAJOR.MINOR"),
    (_doc(_gpu_table(), top='driver_version = "580\\n"\ncuda_version = "13.0"\n'), "driver_version '580\\n' is not"),
    (_doc(_gpu_table(), top='driver_version = "580"\ncuda_version = "13.0\\n"\n'), "cuda_version '13.0\\n' is not"),
    (_doc(_gpu_table(), top='hostname = "node\\n"\ndriver_version = "580"\ncuda_version = "13.0"\n'), "hostname 'node\\n' is not"),
    (_doc(_gpu_table(), _gpu_table(index=1)), f"GPUs number 1 and 2 share uuid {UUID_A}"),
    (_doc(_gpu_table(uuid=UUID_B), _gpu_table(uuid=UUID_B.upper(), index=1)), "share uuid"),   # case-insensitive
    (_doc(_gpu_table(), _gpu_table(uuid=UUID_B)), "GPUs number 1 and 2 share index 0"),
    ('driver_version = "580"\ncuda_version = "13.0"\ngpu = 3\n', "describes no GPUs"),
    ('driver_version = "580"\ncuda_version = "13.0"\ngpu = [1]\n', "[[gpu]] number 1 is not a table"),
])
def test_malformed_inventory_is_one_clear_line(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_inventory(text, "inv.toml")
    message = one_line_error(excinfo)
    assert message.startswith("rgpu: dispatcher: inventory inv.toml: ")
    assert expected in message
    assert excinfo.value.exit_code == 2


@pytest.mark.parametrize("hostile", [
    "NVIDIA H100\nhostname = evil",
    "NVIDIA H100\r\n[[gpu]]",
    "NVIDIA H100\n",                  # a trailing newline slips past re.match(r"...$")
    "x\x00y",
    "H100; rm -rf /",
    "<script>alert(1)</script>",
    "A" * 200,
    "",
])
def test_hostile_gpu_names_are_refused_on_one_line(hostile: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_inventory(_doc(_gpu_table(name=hostile)), "inv.toml")
    message = one_line_error(excinfo)
    assert "is not a GPU model name" in message
    assert len(message) < 400


def test_hostile_uuid_and_key_stay_on_one_line() -> None:
    for text in (_doc(_gpu_table(uuid="GPU-1\nindex = 5")),
                 _doc(_gpu_table()) + '"evil\\nkey" = 1\n'):
        with pytest.raises(ConfigError) as excinfo:
            parse_inventory(text, "inv.toml")
        one_line_error(excinfo)


def test_too_many_gpus_is_refused() -> None:
    tables = [_gpu_table(uuid=f"GPU-{i:08x}", index=i) for i in range(65)]
    with pytest.raises(ConfigError, match="describes 65 GPUs"):
        parse_inventory(_doc(*tables))


def test_inventory_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        StaticInventory(tmp_path / "missing.toml").read()
    assert "cannot be read (No such file or directory" in one_line_error(excinfo)

    with pytest.raises(ConfigError, match="is not a regular file"):
        StaticInventory(tmp_path).read()

    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        StaticInventory(binary).read()

    huge = tmp_path / "huge.toml"
    huge.write_text("# " + "x" * 300_000)
    with pytest.raises(ConfigError, match=r"is 300002 bytes \(an inventory is at most"):
        StaticInventory(huge).read()


# --- selection: RGPU_VISIBLE_DEVICES / BF_VISIBLE_DEVICES --------------------------------------------

def test_all_gpus_when_unset() -> None:
    node = read_node_settings({})
    assert node.visible is None and node.memory_limit is None and node.port_range == DEFAULT_PORT_RANGE
    assert select_gpus(gpus(), node.visible, node.visible_source) == gpus()


@pytest.mark.parametrize("value, indices", [
    ("0", [0]),
    ("2,0", [0, 2]),                     # inventory order, not list order
    (" 1 , 2 ", [1, 2]),
    ("01", [1]),
    (UUID_B, [1]),
    (UUID_B.upper(), [1]),               # UUIDs compare case-insensitively
    (f"0,{UUID_C}", [0, 2]),
])
def test_select_by_index_and_uuid(value: str, indices: list[int]) -> None:
    node = read_node_settings({"RGPU_VISIBLE_DEVICES": value})
    assert [g.index for g in select_gpus(gpus(), node.visible, node.visible_source)] == indices


def test_unknown_devices_are_named() -> None:
    node = read_node_settings({"RGPU_VISIBLE_DEVICES": "0,7,GPU-deadbeef-0000-0000-0000-000000000000"})
    with pytest.raises(ConfigError) as excinfo:
        select_gpus(gpus(), node.visible, node.visible_source)
    message = one_line_error(excinfo)
    assert "$RGPU_VISIBLE_DEVICES names GPUs this host does not have: 7, GPU-deadbeef-0000-0000-0000-000000000000" in message
    assert f"0={UUID_A}" in message   # says what the host has


def test_same_gpu_by_index_and_uuid_is_refused() -> None:
    node = read_node_settings({"RGPU_VISIBLE_DEVICES": f"1,{UUID_B}"})
    with pytest.raises(ConfigError, match="selects GPU 1 .* twice"):
        select_gpus(gpus(), node.visible, node.visible_source)


@pytest.mark.parametrize("value, why", [
    ("0,,1", "it has an empty entry"),
    ("0,0", "0 is listed twice"),
    ("0,00", "0 is listed twice"),
    ("first", "'first' is neither an index nor a GPU UUID"),
    ("-1", "'-1' is neither"),
    ("0;reboot", "is neither"),
    ("0\n1", "is neither"),
    ("١", "is neither"),   # Arabic-Indic digit: isdigit() is true, int() would accept it
])
def test_malformed_visible_devices(value: str, why: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        read_node_settings({"RGPU_VISIBLE_DEVICES": value})
    message = one_line_error(excinfo)
    assert message.startswith("rgpu: dispatcher: $RGPU_VISIBLE_DEVICES=")
    assert why in message


def test_bitfusion_alias_and_precedence() -> None:
    assert read_node_settings({"BF_VISIBLE_DEVICES": "1"}).visible == ("1",)
    both = read_node_settings({"BF_VISIBLE_DEVICES": "1", "RGPU_VISIBLE_DEVICES": "2"})
    assert both.visible == ("2",) and both.visible_source == "RGPU_VISIBLE_DEVICES"
    assert both.ignored == ("BF_VISIBLE_DEVICES",)
    # an empty RGPU_ value counts as unset, so the BF_ one applies and nothing is "ignored"
    empty = read_node_settings({"BF_VISIBLE_DEVICES": "1", "RGPU_VISIBLE_DEVICES": ""})
    assert empty.visible == ("1",) and empty.ignored == ()
    with pytest.raises(ConfigError, match=r"^rgpu: dispatcher: \$BF_VISIBLE_DEVICES='x'"):
        read_node_settings({"BF_VISIBLE_DEVICES": "x"})


# --- memory limit: RGPU_GPU_DEVICE_MEMORY_LIMIT / BF_GPU_DEVICE_MEMORY_LIMIT ---------------------------

@pytest.mark.parametrize("value, usable_gib", [
    ("20G", [20, 20, 20]),
    ("20GiB", [20, 20, 20]),
    ("60G", [60, 60, 40]),        # never more than the GPU has
    ("1T", [80, 80, 40]),
    ("50%", [40, 40, 20]),
    ("100%", [80, 80, 40]),
    ("20480", [20, 20, 20]),      # bare number: MiB, as in Bitfusion's recipes
])
def test_memory_limit(value: str, usable_gib: list[int]) -> None:
    node = read_node_settings({"RGPU_GPU_DEVICE_MEMORY_LIMIT": value})
    limited = apply_memory_limit(gpus(), node.memory_limit)
    assert [g.usable_memory_bytes / GiB for g in limited] == usable_gib
    assert [g.total_memory_bytes for g in limited] == [g.total_memory_bytes for g in gpus()]


def test_percentage_rounds_down() -> None:
    limit = parse_memory_limit(EnvValue("33.3%", "RGPU_GPU_DEVICE_MEMORY_LIMIT"))
    assert limit.usable(1000) == 333
    assert limit.describe() == "33.3% per GPU from $RGPU_GPU_DEVICE_MEMORY_LIMIT"


@pytest.mark.parametrize("value", ["0", "0%", "150%", "-5G", "lots", "nan%", "inf%", "20 G B", "%"])
def test_malformed_memory_limit(value: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        read_node_settings({"RGPU_GPU_DEVICE_MEMORY_LIMIT": value})
    message = one_line_error(excinfo)
    assert "$RGPU_GPU_DEVICE_MEMORY_LIMIT=" in message and "is invalid" in message


def test_memory_limit_alias_and_precedence() -> None:
    bf = read_node_settings({"BF_GPU_DEVICE_MEMORY_LIMIT": "10G"}).memory_limit
    assert bf is not None and bf.bytes == 10 * GiB and bf.source == "BF_GPU_DEVICE_MEMORY_LIMIT"
    both = read_node_settings({"BF_GPU_DEVICE_MEMORY_LIMIT": "10G", "RGPU_GPU_DEVICE_MEMORY_LIMIT": "50%"})
    assert both.memory_limit is not None and both.memory_limit.percent == 50
    assert both.ignored == ("BF_GPU_DEVICE_MEMORY_LIMIT",)


# --- data-port range -------------------------------------------------------------------------------

@pytest.mark.parametrize("env, expected", [
    ({}, (45201, 46225)),
    ({"RGPU_SERVER_PORT_MIN": "50000", "RGPU_SERVER_PORT_MAX": "50100"}, (50000, 50100)),
    ({"BF_SERVER_PORT_MIN": "40000"}, (40000, 46225)),
    ({"BF_SERVER_PORT_MIN": "40000", "RGPU_SERVER_PORT_MIN": "41000"}, (41000, 46225)),
    ({"RGPU_SERVER_PORT_MIN": "46000", "BF_SERVER_PORT_MAX": "46000"}, (46000, 46000)),
])
def test_port_range(env: dict[str, str], expected: tuple[int, int]) -> None:
    assert read_node_settings(env).port_range == expected


@pytest.mark.parametrize("env, expected", [
    ({"RGPU_SERVER_PORT_MIN": "0"}, "$RGPU_SERVER_PORT_MIN='0' is invalid (not a TCP port"),
    ({"RGPU_SERVER_PORT_MAX": "65536"}, "$RGPU_SERVER_PORT_MAX='65536' is invalid"),
    ({"BF_SERVER_PORT_MIN": "low"}, "$BF_SERVER_PORT_MIN='low' is invalid"),
    ({"RGPU_SERVER_PORT_MIN": "-1"}, "is invalid"),
    ({"RGPU_SERVER_PORT_MIN": "47000"}, "data-port range 47000-46225 is empty (RGPU_SERVER_PORT_MIN (47000) is above the default maximum"),
    ({"RGPU_SERVER_PORT_MIN": "2000", "BF_SERVER_PORT_MAX": "1000"}, "(RGPU_SERVER_PORT_MIN (2000) is above BF_SERVER_PORT_MAX (1000)"),
])
def test_bad_port_range(env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        read_node_settings(env)
    assert expected in one_line_error(excinfo)


def test_served_gpus_selects_then_limits() -> None:
    inv = parse_inventory(VALID)
    node = NodeSettings(visible=("2", "0"), visible_source="RGPU_VISIBLE_DEVICES",
                        memory_limit=parse_memory_limit(EnvValue("30G", "RGPU_GPU_DEVICE_MEMORY_LIMIT")),
                        port_range=DEFAULT_PORT_RANGE)
    served = served_gpus(inv, node)
    assert [(g.index, g.usable_memory_bytes // GiB) for g in served] == [(0, 30), (2, 30)]


def test_cuda_version_string() -> None:
    assert cuda_version_string(13000) == "13.0"
    assert cuda_version_string(12040) == "12.4"
    assert cuda_version_string(11080) == "11.8"


# --- the real NVML backend (GPU machines only) --------------------------------------------------------

@functools.cache
def nvidia_driver_present() -> bool:
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


needs_gpu = pytest.mark.skipif("not nvidia_driver_present()", reason="no NVIDIA driver on this machine")


@pytest.mark.gpu
@needs_gpu
def test_nvml_inventory_reads_real_gpus() -> None:
    inv = NvmlInventory().read()
    assert not inv.static and inv.hostname is None
    assert re.match(r"^\d+\.\d+", inv.driver_version), inv.driver_version
    assert re.match(r"^\d+\.\d+$", inv.cuda_version), inv.cuda_version
    assert inv.gpus and [g.index for g in inv.gpus] == list(range(len(inv.gpus)))
    for gpu in inv.gpus:
        validate.gpu_uuid(gpu.uuid)
        assert gpu.name and gpu.total_memory_bytes > GiB and gpu.usable_memory_bytes == gpu.total_memory_bytes
        assert re.match(r"^\d+\.\d+$", gpu.compute_capability)
    assert len({g.uuid for g in inv.gpus}) == len(inv.gpus)


@pytest.mark.gpu
@needs_gpu
def test_nvml_selection_and_limit_on_real_gpus() -> None:
    inv = NvmlInventory().read()
    last = inv.gpus[-1]
    node = read_node_settings({"BF_VISIBLE_DEVICES": last.uuid, "RGPU_GPU_DEVICE_MEMORY_LIMIT": "4G"})
    served = served_gpus(inv, node)
    assert [g.uuid for g in served] == [last.uuid]
    assert served[0].usable_memory_bytes == 4 * GiB
    with pytest.raises(ConfigError, match="does not have: 1023"):
        served_gpus(inv, read_node_settings({"RGPU_VISIBLE_DEVICES": "1023"}))


def test_no_driver_is_refused_with_a_hint() -> None:
    if nvidia_driver_present():
        pytest.skip("an NVIDIA driver is present")
    with pytest.raises(ConfigError) as excinfo:
        NvmlInventory().read()
    message = one_line_error(excinfo)
    assert "no usable NVIDIA driver on this host" in message
    assert "install the NVIDIA driver" in message and "--inventory FILE" in message
