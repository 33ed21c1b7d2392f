"""Run real fio jobs and read their JSON output.

A `FioJob` is one fio job as data; `run_fio` runs it with
`--output-format=json` and returns bandwidth, IOPS and completion-latency
percentiles (fio's `clat_ns`) together with the raw JSON.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


class FioError(RuntimeError):
    """fio is missing, failed, or printed something that is not its JSON report."""


@dataclass(frozen=True)
class FioJob:
    """One fio job. `size` is per job; with `numjobs` > 1 each job reads its own file."""

    name: str
    directory: Path
    rw: Literal["read", "write", "randread", "randwrite", "rw", "randrw"]
    bs: str = "1M"
    size: str = "256M"
    direct: bool = True
    ioengine: str = "psync"
    iodepth: int = 1
    numjobs: int = 1
    runtime_s: float | None = None
    extra: tuple[str, ...] = ()

    def argv(self, fio_binary: str = "fio") -> list[str]:
        args = [
            fio_binary, f"--name={self.name}", f"--directory={self.directory}", f"--rw={self.rw}",
            f"--bs={self.bs}", f"--size={self.size}", f"--direct={int(self.direct)}",
            f"--ioengine={self.ioengine}", f"--iodepth={self.iodepth}", f"--numjobs={self.numjobs}",
            "--group_reporting", "--invalidate=1", "--output-format=json",
        ]
        if self.runtime_s:
            args += [f"--runtime={self.runtime_s}", "--time_based"]
        return args + list(self.extra)


@dataclass(frozen=True)
class FioResult:
    job: FioJob
    read_bw_bytes: float
    write_bw_bytes: float
    read_iops: float
    write_iops: float
    clat_p99_ns: float
    raw: dict = field(repr=False)


def fio_version(fio_binary: str = "fio") -> str:
    """fio's version string; raises FioError when fio is not installed."""
    path = shutil.which(fio_binary)
    if path is None:
        raise FioError(f"fio not found on PATH (install Debian's 'fio' package); looked for {fio_binary!r}")
    return subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def run_fio(job: FioJob, fio_binary: str = "fio", timeout_s: float = 600) -> FioResult:
    fio_version(fio_binary)
    Path(job.directory).mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(job.argv(fio_binary), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise FioError(f"fio job {job.name!r} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return parse_fio_json(job, proc.stdout)


def parse_fio_json(job: FioJob, text: str) -> FioResult:
    start = text.find("{")
    try:
        report = json.loads(text[start:])
        stats = report["jobs"][0]
    except (ValueError, KeyError, IndexError) as exc:
        raise FioError(f"fio job {job.name!r}: output is not fio's JSON report ({exc})") from None
    read, write = stats["read"], stats["write"]
    busy = read if read["io_bytes"] >= write["io_bytes"] else write
    p99 = busy.get("clat_ns", {}).get("percentile", {}).get("99.000000", 0.0)
    return FioResult(
        job=job, read_bw_bytes=float(read["bw_bytes"]), write_bw_bytes=float(write["bw_bytes"]),
        read_iops=float(read["iops"]), write_iops=float(write["iops"]), clat_p99_ns=float(p99), raw=report,
    )
