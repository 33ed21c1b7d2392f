"""What this machine has: CPU, memory, GPUs, disks, NVMe, RAID, filesystems, NICs and RDMA devices.

`collect_inventory()` gathers every section into one JSON-ready dict for the
run's environment fingerprint and gate G1's arrival checks (capacity, device
count, NIC present). Each section is a small function that never raises: a
missing tool, file or permission makes the section
`{"available": False, "reason": "..."}`. Commands run with a timeout.
`capacity_of(path)` is the total and free space of the filesystem holding a path.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMAND_TIMEOUT_S = 5.0

# Filesystems that hold no user data (kernel interfaces); tmpfs and overlay are kept.
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "devtmpfs", "mqueue", "debugfs", "tracefs", "securityfs",
    "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "autofs", "binfmt_misc", "rpc_pipefs", "nsfs",
    "efivarfs", "selinuxfs", "ramfs", "nfsd", "fuse.gvfsd-fuse", "fuse.portal",
})


def unavailable(reason: str) -> dict:
    """A section that could not be collected, and why."""
    return {"available": False, "reason": reason}


# --------------------------------------------------------------------------- helpers


def run_command(argv: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> str | dict:
    """The stdout of `argv`, or an `unavailable(...)` dict when the tool is missing, fails or times out."""
    path = shutil.which(argv[0])
    if path is None:
        return unavailable(f"{argv[0]} not found on PATH")
    try:
        proc = subprocess.run([path, *argv[1:]], capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return unavailable(f"{' '.join(argv)} did not finish within {timeout_s:g} s")
    except OSError as exc:
        return unavailable(f"{' '.join(argv)} could not start: {exc}")
    if proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        return unavailable(f"{' '.join(argv)} failed (exit {proc.returncode}): {message[-1] if message else ''}")
    return proc.stdout


def _run_json(argv: list[str]) -> Any:
    """Parsed JSON output of `argv`, or an `unavailable(...)` dict."""
    out = run_command(argv)
    if isinstance(out, dict):
        return out
    try:
        return json.loads(out)
    except ValueError as exc:
        return unavailable(f"{' '.join(argv)} printed no JSON ({exc})")


def _read_text(path: str | os.PathLike) -> str | None:
    """A small text file's content, or None when it is missing or unreadable."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _read_sysfs(path: Path) -> str | None:
    """One sysfs attribute, stripped; None when unreadable (e.g. `speed` of a link that is down)."""
    text = _read_text(path)
    return text.strip() if text is not None else None


# --------------------------------------------------------------------------- sections


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """CPU model and logical core counts (from /proc/cpuinfo, os.cpu_count and this process's affinity)."""
    text = _read_text(cpuinfo_path)
    if text is None:
        return {**unavailable(f"{cpuinfo_path} not readable"), "logical_cores": os.cpu_count()}
    fields = [line.split(":", 1) for line in text.splitlines() if ":" in line]
    values: dict[str, list[str]] = {}
    for key, value in fields:
        values.setdefault(key.strip(), []).append(value.strip())
    model = (values.get("model name") or values.get("Model") or values.get("cpu model")
             or [platform.processor() or platform.machine()])[0]
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "available": True, "model": model, "logical_cores": len(values.get("processor", [])) or os.cpu_count(),
        "os_cpu_count": os.cpu_count(), "usable_cores": affinity, "architecture": platform.machine(),
    }


def memory_info(meminfo_path: str = "/proc/meminfo") -> dict:
    """Total and available memory in bytes, from /proc/meminfo (its kB are KiB)."""
    text = _read_text(meminfo_path)
    if text is None:
        return unavailable(f"{meminfo_path} not readable")
    kib = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+):\s+(\d+)", line)
        if match:
            kib[match.group(1)] = int(match.group(2))
    if "MemTotal" not in kib:
        return unavailable(f"{meminfo_path} has no MemTotal line")
    return {"available": True, "total_bytes": kib["MemTotal"] * 1024,
            "available_bytes": kib.get("MemAvailable", kib.get("MemFree", 0)) * 1024,
            "swap_total_bytes": kib.get("SwapTotal", 0) * 1024}


def gpu_info(nvidia_smi: str = "nvidia-smi") -> dict:
    """NVIDIA GPUs (name, memory) from `nvidia-smi --query-gpu`, or why there are none."""
    out = run_command([nvidia_smi, "--query-gpu=name,memory.total", "--format=csv,noheader"])
    if isinstance(out, dict):
        return out
    gpus = []
    for line in out.strip().splitlines():
        name, _, memory = line.rpartition(",")
        gpus.append({"name": name.strip(), "memory_total_bytes": _mib_to_bytes(memory)})
    return {"available": True, "count": len(gpus), "gpus": gpus}


def _mib_to_bytes(text: str) -> int | None:
    """nvidia-smi's "81559 MiB" as bytes; None when it says something else ("[N/A]")."""
    match = re.match(r"^\s*(\d+)\s*MiB\s*$", text)
    return int(match.group(1)) * 2**20 if match else None


def block_devices(lsblk: str = "lsblk") -> dict:
    """Disks and partitions from `lsblk -J -b` (sizes in bytes, ROTA 0 for SSDs)."""
    data = _run_json([lsblk, "-J", "-b", "-o", "NAME,SIZE,TYPE,ROTA,MODEL,TRAN,MOUNTPOINT"])
    if isinstance(data, dict) and data.get("available") is False:
        return data
    devices = data.get("blockdevices", []) if isinstance(data, dict) else []
    disks = [d for d in devices if d.get("type") == "disk"]
    return {"available": True, "disk_count": len(disks), "devices": devices}


def nvme_devices(nvme: str = "nvme") -> dict:
    """NVMe devices from `nvme list -o json` (nvme-cli); needs root on most systems."""
    data = _run_json([nvme, "list", "-o", "json"])
    if isinstance(data, dict) and data.get("available") is False:
        return data
    devices = data.get("Devices", []) if isinstance(data, dict) else []
    return {"available": True, "count": len(devices), "devices": devices}


def parse_mdstat(text: str) -> dict:
    """Software RAID arrays from /proc/mdstat: name, state, level, member devices, degraded, resync progress."""
    header = next((line for line in text.splitlines() if line.startswith("Personalities")), "")
    personalities = re.findall(r"\[(\w+)\]", header)
    arrays, current = [], None
    for line in text.splitlines():
        head = re.match(r"^(md\w*)\s*:\s*(\S+)\s+(.*)$", line)
        if head:
            name, state, rest = head.groups()
            words = [w for w in rest.split() if not w.startswith("(")]
            level = words[0] if words and "[" not in words[0] else None
            members = [w for w in words if "[" in w]
            current = {"name": name, "state": state, "level": level,
                       "devices": [re.sub(r"\[\d+\].*", "", m) for m in members],
                       "failed_devices": [re.sub(r"\[\d+\].*", "", m) for m in rest.split() if m.endswith("(F)")],
                       "degraded": False, "progress": None}
            arrays.append(current)
        elif current is not None and line.startswith((" ", "\t")):
            status = re.search(r"\[(\d+)/(\d+)\]\s+\[([U_]+)\]", line)
            if status:
                current["members_expected"], current["members_up"] = int(status.group(1)), int(status.group(2))
                current["degraded"] = "_" in status.group(3)
            progress = re.search(r"(recovery|resync|reshape|check)\s*=\s*([\d.]+)%", line)
            if progress:
                current["progress"] = {"action": progress.group(1), "percent": float(progress.group(2))}
        elif not line.strip():
            current = None
    return {"personalities": personalities, "arrays": arrays}


def parse_mdadm_scan(text: str) -> list[dict]:
    """`mdadm --detail --scan` lines ("ARRAY /dev/md0 metadata=1.2 name=h:0 UUID=...") as dicts."""
    arrays = []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "ARRAY":
            entry = {"device": words[1]}
            for word in words[2:]:
                if "=" in word:
                    key, value = word.split("=", 1)
                    entry[key] = value
            arrays.append(entry)
    return arrays


def raid_info(mdstat_path: str = "/proc/mdstat", mdadm: str = "mdadm") -> dict:
    """Linux software RAID: /proc/mdstat parsed, plus `mdadm --detail --scan` when mdadm is installed."""
    text = _read_text(mdstat_path)
    if text is None:
        return unavailable(f"{mdstat_path} not readable (md driver not loaded: no software RAID)")
    scan = run_command([mdadm, "--detail", "--scan"])
    mdadm_section = scan if isinstance(scan, dict) else {"available": True, "arrays": parse_mdadm_scan(scan)}
    return {"available": True, **parse_mdstat(text), "mdadm": mdadm_section}


def _unescape_mount_field(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _statvfs(path: str, timeout_s: float) -> os.statvfs_result | str:
    """os.statvfs(path), or why not; in a daemon thread so a hung network mount cannot hang the inventory."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = os.statvfs(path)
        except OSError as exc:
            box["error"] = exc.strerror or str(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"statvfs did not answer within {timeout_s:g} s"
    return box.get("result", box.get("error", "statvfs failed"))


def _space(st: os.statvfs_result) -> dict:
    """Sizes from statvfs: total, free to unprivileged users (what `df` shows as available), used."""
    total = st.f_blocks * st.f_frsize
    return {"total_bytes": total, "free_bytes": st.f_bavail * st.f_frsize,
            "used_bytes": total - st.f_bfree * st.f_frsize}


def filesystems(mounts_path: str = "/proc/mounts", timeout_s: float = COMMAND_TIMEOUT_S) -> dict:
    """Mounted real filesystems (pseudo ones like proc, sysfs, cgroup skipped) with total/free bytes."""
    text = _read_text(mounts_path)
    if text is None:
        return unavailable(f"{mounts_path} not readable")
    by_mountpoint: dict[str, dict] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[2] in PSEUDO_FILESYSTEMS:
            continue
        device, mountpoint, fstype = (_unescape_mount_field(p) for p in parts[:3])
        entry = {"device": device, "mountpoint": mountpoint, "fstype": fstype}
        st = _statvfs(mountpoint, timeout_s)
        entry.update(_space(st) if isinstance(st, os.statvfs_result) else {"error": st})
        by_mountpoint[mountpoint] = entry  # a later mount on the same point hides the earlier one
    return {"available": True, "filesystems": list(by_mountpoint.values())}


def nics(sys_net: str = "/sys/class/net") -> dict:
    """Network interfaces from sysfs: name, operstate, MAC, speed in Mb/s (None when unreadable), MTU."""
    root = Path(sys_net)
    if not root.is_dir():
        return unavailable(f"{sys_net} not found")
    interfaces = []
    for path in sorted(root.iterdir()):
        speed = _read_sysfs(path / "speed")
        interfaces.append({
            "name": path.name, "operstate": _read_sysfs(path / "operstate"), "mac": _read_sysfs(path / "address"),
            "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None,
            "mtu": int(m) if (m := _read_sysfs(path / "mtu")) and m.isdigit() else None,
            "physical": (path / "device").exists(),
        })
    return {"available": True, "count": len(interfaces), "interfaces": interfaces}


def rdma_devices(sys_ib: str = "/sys/class/infiniband") -> dict:
    """RDMA devices (InfiniBand or RoCE) from sysfs: each device's ports with link layer, state and rate."""
    root = Path(sys_ib)
    if not root.is_dir():
        return unavailable(f"{sys_ib} not found (no RDMA devices or drivers)")
    devices = []
    for device in sorted(root.iterdir()):
        ports_dir = device / "ports"
        ports = [{
            "port": port.name, "link_layer": _read_sysfs(port / "link_layer"), "state": _read_sysfs(port / "state"),
            "phys_state": _read_sysfs(port / "phys_state"), "rate": _read_sysfs(port / "rate"),
        } for port in (sorted(ports_dir.iterdir(), key=lambda p: p.name) if ports_dir.is_dir() else [])]
        devices.append({"name": device.name, "ports": ports})
    return {"available": True, "count": len(devices), "devices": devices}


def host_info() -> dict:
    """Hostname, kernel, OS release and Python version."""
    os_release = _read_text("/etc/os-release") or ""
    pretty = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', os_release, flags=re.MULTILINE)
    return {"available": True, "hostname": platform.node(), "kernel": platform.release(),
            "os": pretty.group(1) if pretty else platform.system(), "python": platform.python_version()}


# --------------------------------------------------------------------------- entry points


SECTIONS: dict[str, Callable[[], dict]] = {
    "host": host_info, "cpu": cpu_info, "memory": memory_info, "gpus": gpu_info, "block_devices": block_devices,
    "nvme": nvme_devices, "raid": raid_info, "filesystems": filesystems, "nics": nics, "rdma": rdma_devices,
}


def collect_inventory() -> dict:
    """Every section of the inventory; a section that fails in an unexpected way says so instead of raising."""
    started = time.monotonic()
    inventory: dict[str, Any] = {}
    for name, collect in SECTIONS.items():
        try:
            inventory[name] = collect()
        except Exception as exc:  # noqa: BLE001 — an inventory must never stop a run
            inventory[name] = unavailable(f"{type(exc).__name__}: {exc}")
    inventory["collected_in_s"] = round(time.monotonic() - started, 3)
    return inventory


def capacity_of(path: str | os.PathLike) -> dict:
    """Total, free (available to unprivileged users) and used bytes of the filesystem holding `path`.

    A path that does not exist yet is measured at its nearest existing parent
    (the directory it would be created in); `measured_at` says which.
    """
    target = Path(path).absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        st = os.statvfs(target)
    except OSError as exc:
        return {"path": str(path), **unavailable(f"statvfs({target}) failed: {exc.strerror or exc}")}
    return {"available": True, "path": str(path), "measured_at": str(target), **_space(st)}
