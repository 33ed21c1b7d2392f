"""The machine inventory: every section present, real figures on this machine, missing tools never raise."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from workloads.storage.inventory import (
    SECTIONS,
    block_devices,
    capacity_of,
    collect_inventory,
    cpu_info,
    filesystems,
    gpu_info,
    memory_info,
    nics,
    nvme_devices,
    parse_mdadm_scan,
    raid_info,
    rdma_devices,
    run_command,
)

MDSTAT = """\
Personalities : [raid1] [raid6] [raid5] [raid4]
md0 : active raid1 sdb1[1] sda1[0]
      1953382464 blocks super 1.2 [2/2] [UU]
      bitmap: 0/15 pages [0KB], 65536KB chunk

md1 : active raid5 nvme2n1[3] nvme1n1[1] nvme0n1[0](F)
      7813774336 blocks super 1.2 level 5, 512k chunk, algorithm 2 [3/2] [_UU]
      [=>...................]  recovery =  8.5% (332168448/3906887168) finish=292.7min speed=203512K/sec

md127 : inactive sdc[0](S)
      976630488 blocks super 1.2

unused devices: <none>
"""


def _mountpoint_of(path: Path) -> str:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return str(path)


def _fake_tool(directory: Path, name: str, stdout: str) -> str:
    """An executable that prints `stdout`, standing in for a tool this machine lacks."""
    tool = directory / name
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{stdout}\nEOF\n")
    tool.chmod(0o755)
    return str(tool)


# ----------------------------------------------------------------------------- the whole inventory


def test_inventory_has_every_section_each_saying_whether_it_is_available():
    inventory = collect_inventory()
    assert set(SECTIONS) <= set(inventory)
    assert {"cpu", "memory", "gpus", "block_devices", "nvme", "raid", "filesystems", "nics", "rdma"} <= set(inventory)
    for name in SECTIONS:
        section = inventory[name]
        assert isinstance(section["available"], bool), name
        if not section["available"]:
            assert section["reason"], name
    json.dumps(inventory)  # goes into results.json as it is


def test_this_machine_has_cores_and_memory():
    inventory = collect_inventory()
    assert inventory["cpu"]["available"] and inventory["cpu"]["logical_cores"] >= 1
    assert inventory["cpu"]["os_cpu_count"] == os.cpu_count()
    assert inventory["memory"]["total_bytes"] > 0
    assert 0 < inventory["memory"]["available_bytes"] <= inventory["memory"]["total_bytes"]


def test_filesystems_include_the_one_holding_tmp_path_with_free_space(tmp_path):
    listed = {fs["mountpoint"]: fs for fs in collect_inventory()["filesystems"]["filesystems"]}
    holding = listed[_mountpoint_of(tmp_path)]
    assert holding["free_bytes"] > 0 and holding["total_bytes"] >= holding["free_bytes"]
    assert not {"proc", "sysfs", "cgroup", "cgroup2"} & {fs["fstype"] for fs in listed.values()}


def test_whole_collection_finishes_quickly():
    started = time.monotonic()
    inventory = collect_inventory()
    elapsed = time.monotonic() - started
    assert elapsed < 5
    assert 0 <= inventory["collected_in_s"] < 5  # the inventory records its own collection time


def test_with_path_emptied_every_tool_section_is_unavailable_and_nothing_raises(monkeypatch):
    monkeypatch.setenv("PATH", "")
    inventory = collect_inventory()
    for name, tool in (("gpus", "nvidia-smi"), ("block_devices", "lsblk"), ("nvme", "nvme")):
        assert inventory[name] == {"available": False, "reason": f"{tool} not found on PATH"}
    assert inventory["cpu"]["available"] and inventory["memory"]["available"]  # files, not tools


# ----------------------------------------------------------------------------- capacity_of


def test_capacity_of_tmp_path_reports_total_and_free_bytes(tmp_path):
    capacity = capacity_of(tmp_path)
    assert capacity["available"] and capacity["measured_at"] == str(tmp_path)
    assert capacity["total_bytes"] >= capacity["free_bytes"] > 0


def test_capacity_of_a_path_not_yet_created_is_measured_at_its_existing_parent(tmp_path):
    capacity = capacity_of(tmp_path / "not" / "yet")
    assert capacity["measured_at"] == str(tmp_path)
    assert capacity["total_bytes"] == capacity_of(tmp_path)["total_bytes"]


# ----------------------------------------------------------------------------- commands


def test_a_tool_that_does_not_exist_makes_its_section_unavailable_with_a_reason():
    assert gpu_info(nvidia_smi="no-such-nvidia-smi") == {
        "available": False, "reason": "no-such-nvidia-smi not found on PATH"}
    assert nvme_devices(nvme="no-such-nvme")["available"] is False
    assert block_devices(lsblk="no-such-lsblk")["reason"] == "no-such-lsblk not found on PATH"


def test_a_failing_or_hanging_command_is_unavailable_with_its_exit_status_or_timeout():
    failed = run_command(["false"])
    assert failed["available"] is False and "exit 1" in failed["reason"]
    started = time.monotonic()
    hung = run_command(["sleep", "10"], timeout_s=0.2)
    assert hung["available"] is False and "did not finish within 0.2 s" in hung["reason"]
    assert time.monotonic() - started < 5


def test_a_tool_that_prints_no_json_is_unavailable_not_an_error():
    section = block_devices(lsblk="echo")
    assert section["available"] is False and "printed no JSON" in section["reason"]


def test_nvidia_smi_csv_lines_become_gpus_with_memory_in_bytes(tmp_path):
    tool = _fake_tool(tmp_path, "nvidia-smi", "NVIDIA H200, 143771 MiB\nNVIDIA H200, 143771 MiB")
    section = gpu_info(nvidia_smi=tool)
    assert section["available"] and section["count"] == 2
    assert section["gpus"][0] == {"name": "NVIDIA H200", "memory_total_bytes": 143771 * 2**20}


def test_nvidia_smi_without_a_driver_is_unavailable_with_its_message(tmp_path):
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'"
                    "\nexit 9\n")
    tool.chmod(0o755)
    section = gpu_info(nvidia_smi=str(tool))
    assert section["available"] is False
    assert "exit 9" in section["reason"] and "could not communicate" in section["reason"]


def test_nvme_list_json_devices_are_counted(tmp_path):
    listing = {"Devices": [{"DevicePath": "/dev/nvme0n1", "ModelNumber": "Fake SSD", "PhysicalSize": 3840755982336}]}
    section = nvme_devices(nvme=_fake_tool(tmp_path, "nvme", json.dumps(listing)))
    assert section["available"] and section["count"] == 1
    assert section["devices"][0]["ModelNumber"] == "Fake SSD"


@pytest.mark.skipif(not Path("/usr/bin/lsblk").exists() and not Path("/bin/lsblk").exists(),
                    reason="lsblk (util-linux) is not installed")
def test_lsblk_lists_disks_with_sizes_in_bytes():
    section = block_devices()
    assert section["available"] and section["disk_count"] >= 1
    assert all(isinstance(d["size"], int) for d in section["devices"])


# ----------------------------------------------------------------------------- RAID


def test_mdstat_arrays_are_parsed_with_level_members_degraded_and_recovery(tmp_path):
    mdstat = tmp_path / "mdstat"
    mdstat.write_text(MDSTAT)
    section = raid_info(mdstat_path=str(mdstat), mdadm="no-such-mdadm")
    assert section["available"] and section["personalities"] == ["raid1", "raid6", "raid5", "raid4"]
    md0, md1, md127 = section["arrays"]
    assert (md0["name"], md0["state"], md0["level"], md0["devices"], md0["degraded"]) == (
        "md0", "active", "raid1", ["sdb1", "sda1"], False)
    assert (md1["level"], md1["degraded"], md1["failed_devices"]) == ("raid5", True, ["nvme0n1"])
    assert (md1["members_expected"], md1["members_up"]) == (3, 2)
    assert md1["progress"] == {"action": "recovery", "percent": 8.5}
    assert (md127["state"], md127["level"], md127["devices"]) == ("inactive", None, ["sdc"])
    assert section["mdadm"] == {"available": False, "reason": "no-such-mdadm not found on PATH"}


def test_missing_mdstat_means_no_software_raid_not_an_error(tmp_path):
    section = raid_info(mdstat_path=str(tmp_path / "absent"))
    assert section["available"] is False and "not readable" in section["reason"]


def test_mdadm_scan_lines_become_arrays_with_their_attributes():
    scan = "ARRAY /dev/md0 metadata=1.2 name=host:0 UUID=1d2c3b4a:5e6f7a8b:9c0d1e2f:3a4b5c6d\n"
    assert parse_mdadm_scan(scan) == [{"device": "/dev/md0", "metadata": "1.2", "name": "host:0",
                                       "UUID": "1d2c3b4a:5e6f7a8b:9c0d1e2f:3a4b5c6d"}]


# ----------------------------------------------------------------------------- files and sysfs


def test_filesystems_skip_pseudo_ones_decode_escapes_and_report_unreachable_mounts(tmp_path):
    spaced = tmp_path / "kv cache"
    spaced.mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "proc /proc proc rw 0 0\nsysfs /sys sysfs rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n"
        f"/dev/vdb {str(spaced).replace(' ', chr(92) + '040')} ext4 rw 0 0\n"
        "/dev/sdz /no/such/mount xfs rw 0 0\n")
    listed = filesystems(mounts_path=str(mounts))["filesystems"]
    assert [fs["mountpoint"] for fs in listed] == [str(spaced), "/no/such/mount"]
    assert listed[0]["fstype"] == "ext4" and listed[0]["free_bytes"] > 0
    assert "error" in listed[1] and "free_bytes" not in listed[1]


def test_cpu_and_memory_are_read_from_proc_format_files(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("".join(f"processor\t: {i}\nmodel name\t: Fake CPU 9000\n\n" for i in range(3)))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n")
    cpu = cpu_info(cpuinfo_path=str(cpuinfo))
    assert (cpu["model"], cpu["logical_cores"]) == ("Fake CPU 9000", 3)
    assert memory_info(meminfo_path=str(meminfo))["total_bytes"] == 16384 * 1024
    assert memory_info(meminfo_path=str(meminfo))["available_bytes"] == 8192 * 1024
    assert memory_info(meminfo_path=str(tmp_path / "absent"))["available"] is False


def test_nics_report_state_mac_and_speed_when_readable(tmp_path):
    for name, files in {"eth0": {"operstate": "up", "address": "02:00:00:00:00:01", "speed": "100000", "mtu": "9000"},
                        "eth1": {"operstate": "down", "address": "02:00:00:00:00:02", "mtu": "1500"}}.items():
        (tmp_path / name).mkdir()
        for attr, value in files.items():
            (tmp_path / name / attr).write_text(value + "\n")
    (tmp_path / "eth0" / "device").mkdir()
    section = nics(sys_net=str(tmp_path))
    eth0, eth1 = section["interfaces"]
    assert eth0 == {"name": "eth0", "operstate": "up", "mac": "02:00:00:00:00:01", "speed_mbps": 100000,
                    "mtu": 9000, "physical": True}
    assert (eth1["speed_mbps"], eth1["physical"]) == (None, False)  # speed unreadable on a down link


def test_rdma_devices_list_each_port_link_layer_and_state(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    for attr, value in {"link_layer": "Ethernet", "state": "4: ACTIVE", "phys_state": "5: LinkUp",
                        "rate": "100 Gb/sec (4X EDR)"}.items():
        (port / attr).write_text(value + "\n")
    section = rdma_devices(sys_ib=str(tmp_path))
    assert section["count"] == 1
    assert section["devices"][0]["ports"] == [{"port": "1", "link_layer": "Ethernet", "state": "4: ACTIVE",
                                               "phys_state": "5: LinkUp", "rate": "100 Gb/sec (4X EDR)"}]
    assert rdma_devices(sys_ib=str(tmp_path / "absent"))["available"] is False
