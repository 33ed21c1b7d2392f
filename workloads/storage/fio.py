"""Run real fio jobs and read their JSON output.

A `FioJob` is one fio job as data; `run_fio` runs it with
`--output-format=json` and returns a `FioResult`: bandwidth in bytes/s, IOPS
and completion-latency mean/p50/p99/p99.9 in nanoseconds, read from fio 3's
`bw_bytes` and `clat_ns` (fio 2.x reports, with `bw` in KiB/s and `clat` in
microseconds, are refused with a FioError). A `FioMatrix` is a set of jobs run together
by `run_matrix` (sequential and random reads and writes, a mixed 70/30 job and
optionally a crc32c verify pass); `results_frame` tabulates the results.

Before running, `run_fio` checks what would otherwise fail late or obscurely:
fio is installed, the directory is writable, and the files fit its free space.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvcore.settings import format_size

if TYPE_CHECKING:  # pandas is imported lazily: the CLI imports this module and should start fast
    import pandas as pd

RW = Literal["read", "write", "randread", "randwrite", "rw", "randrw"]


class FioError(RuntimeError):
    """fio is missing, failed, cannot run where asked, or printed something that is not its JSON report."""


# --------------------------------------------------------------------------- jobs


# A read job's buffers are written (zeros) when fio sets up, before anything is timed. Untouched, an O_DIRECT
# read faults its buffer in inside the timed window (pinning the pages, zeroing huge pages): the sweep's best
# direct job, QD32 x 16 MiB, read a 128 MiB region at 0.30-1.01 GB/s in 7 of 8 runs on the development VM,
# and at 1.47-2.10 in 5 of 8 with its buffers touched first (its other runs stalled, as every job here does
# now and then). A reader's destination (an engine's KV, a model's parameters) exists before it reads, so
# the storage's best is measured with buffers that do too. Writes keep fio's default random buffers: zeros
# would flatter a storage that compresses.
READS = ("read", "randread")


@dataclass(frozen=True)
class FioJob:
    """One fio job. `size` is per job; with `numjobs` > 1 each job reads its own file.

    `verify` (for example "crc32c") makes a write job read its data back and
    check it (`--verify=... --do_verify=1`); `rwmixread` is the read share of
    a mixed (`rw`/`randrw`) job in percent.
    """

    name: str
    directory: Path
    rw: RW
    bs: str = "1M"
    size: str | None = "256M"   # None: the files' own sizes (reading existing files)
    direct: bool = True
    ioengine: str = "psync"
    iodepth: int = 1
    numjobs: int = 1
    runtime_s: float | None = None
    extra: tuple[str, ...] = ()
    rwmixread: int | None = None
    verify: str | None = None

    @property
    def read_only(self) -> bool:
        """A job that only reads existing files (`--readonly`): it needs no write access and no free space."""
        return "--readonly" in self.extra

    def argv(self, fio_binary: str = "fio") -> list[str]:
        """fio's command line for this job (JSON output, one group report for all `numjobs`)."""
        args = [
            fio_binary, f"--name={self.name}", f"--directory={self.directory}", f"--rw={self.rw}",
            f"--bs={self.bs}", *([f"--size={self.size}"] if self.size is not None else []),
            f"--direct={int(self.direct)}",
            f"--ioengine={self.ioengine}", f"--iodepth={self.iodepth}", f"--numjobs={self.numjobs}",
            "--group_reporting", "--invalidate=1", "--output-format=json",
        ]
        if self.rw in READS:
            args.append("--zero_buffers")   # touched before timing (READS)
        if self.runtime_s:
            args += [f"--runtime={_fio_seconds(self.runtime_s)}", "--time_based"]
        if self.rwmixread is not None:
            args.append(f"--rwmixread={self.rwmixread}")
        if self.verify:
            # verify_state_save=0: fio would otherwise leave a *-verify.state file in the working directory
            args += [f"--verify={self.verify}", "--do_verify=1", "--verify_state_save=0"]
        return args + list(self.extra)


def _fio_seconds(seconds: float) -> str:
    """A duration fio reads exactly: whole seconds as "5", fractions as milliseconds ("1500ms")."""
    if float(seconds).is_integer():
        return str(int(seconds))
    return f"{round(seconds * 1000)}ms"


@dataclass(frozen=True)
class FioPattern:
    """One access pattern of a matrix: fio's `rw`, a block size, and the read share of mixed jobs."""

    name: str
    rw: RW
    bs: str
    rwmixread: int | None = None


DEFAULT_PATTERNS: tuple[FioPattern, ...] = (
    FioPattern("seq-read", "read", "1M"),
    FioPattern("seq-write", "write", "1M"),
    FioPattern("rand-read", "randread", "4k"),
    FioPattern("rand-write", "randwrite", "4k"),
    FioPattern("rand-rw-70-30", "randrw", "4k", rwmixread=70),
)


@dataclass(frozen=True)
class FioMatrix:
    """A set of fio jobs sharing iodepth, numjobs, size, runtime, I/O mode and engine.

    The default is the arrival baseline: sequential read and write at 1 MiB,
    random read and write at 4 KiB and mixed random 70/30 at 4 KiB. With
    `verify`, a crc32c write-and-verify job (`verify_size`, default `size`)
    is appended.
    """

    patterns: tuple[FioPattern, ...] = DEFAULT_PATTERNS
    size: str = "1G"
    runtime_s: float | None = 30
    iodepth: int = 16
    numjobs: int = 1
    direct: bool = True
    ioengine: str = "libaio"
    verify: bool = False
    verify_size: str | None = None

    def __post_init__(self) -> None:
        if not self.patterns:
            raise ValueError("FioMatrix.patterns: expected at least one pattern, found none")
        for name in ("iodepth", "numjobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"FioMatrix.{name}: expected a value >= 1, found {getattr(self, name)}")
        if self.runtime_s is not None and self.runtime_s <= 0:
            raise ValueError(f"FioMatrix.runtime_s: expected a positive number or None, found {self.runtime_s}")
        for pattern in self.patterns:
            if pattern.rwmixread is not None and not 0 <= pattern.rwmixread <= 100:
                raise ValueError(f"FioMatrix pattern {pattern.name!r}: rwmixread must be 0-100, "
                                 f"found {pattern.rwmixread}")

    def jobs(self, directory: str | os.PathLike) -> list[FioJob]:
        """The matrix's jobs, in order, all in `directory`."""
        jobs = [
            FioJob(name=p.name, directory=Path(directory), rw=p.rw, bs=p.bs, size=self.size, direct=self.direct,
                   ioengine=self.ioengine, iodepth=self.iodepth, numjobs=self.numjobs, runtime_s=self.runtime_s,
                   rwmixread=p.rwmixread)
            for p in self.patterns
        ]
        if self.verify:
            jobs.append(verify_job(directory, size=self.verify_size or self.size, direct=self.direct,
                                   ioengine=self.ioengine, iodepth=self.iodepth))
        return jobs


def verify_job(directory: str | os.PathLike, size: str = "64M", bs: str = "1M", direct: bool = True,
               ioengine: str = "psync", iodepth: int = 1, method: str = "crc32c") -> FioJob:
    """A job that writes `size` with `method` checksums in each block, then reads it back and checks them."""
    return FioJob(name=f"verify-{method}", directory=Path(directory), rw="write", bs=bs, size=size, direct=direct,
                  ioengine=ioengine, iodepth=iodepth, verify=method)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ClatStats:
    """Completion latency of one direction in nanoseconds (all 0.0 when that direction did no I/O)."""

    mean_ns: float = 0.0
    p50_ns: float = 0.0
    p99_ns: float = 0.0
    p999_ns: float = 0.0


@dataclass(frozen=True)
class FioResult:
    """One job's figures, normalised: bandwidth in bytes/s, latency in ns.

    The top-level `clat_*` figures are those of the busier direction (more
    bytes moved: reads for a 70/30 mix); `read_clat` and `write_clat` hold
    both. `verify_ok` is None for jobs without verification, otherwise
    whether fio exited cleanly with no job error; `verify_errors` then holds
    fio's error output.
    """

    job: FioJob
    read_bw_bytes: float
    write_bw_bytes: float
    read_iops: float
    write_iops: float
    clat_p99_ns: float
    raw: dict = field(repr=False)
    clat_mean_ns: float = 0.0
    clat_p50_ns: float = 0.0
    clat_p999_ns: float = 0.0
    read_clat: ClatStats = ClatStats()
    write_clat: ClatStats = ClatStats()
    fio_version: str = ""
    error: int = 0
    verify_ok: bool | None = None
    verify_errors: str = ""

    @property
    def iops(self) -> float:
        """Read plus write IOPS."""
        return self.read_iops + self.write_iops


# --------------------------------------------------------------------------- parsing


def _find_report(text: str) -> tuple[dict, int, int] | None:
    """fio's JSON report in `text` with its start and end offsets, or None."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"^\s*\{", text, flags=re.MULTILINE):
        try:
            report, end = decoder.raw_decode(text, match.end() - 1)
        except ValueError:
            continue
        if isinstance(report, dict) and "jobs" in report:
            return report, match.end() - 1, end
    return None


def extract_report(text: str) -> dict:
    """fio's JSON report out of its stdout, ignoring text printed before or after it (warnings, notes)."""
    found = _find_report(text)
    if found is None:
        raise FioError(f"output is not fio's JSON report: {text.strip()[:300]!r}")
    return found[0]


def text_around_report(text: str) -> str:
    """What fio printed on stdout besides its JSON report (warnings, notes, per-job error lines)."""
    found = _find_report(text)
    if found is None:
        return text.strip()
    _, start, end = found
    return "\n".join(part.strip() for part in (text[:start], text[end:]) if part.strip())


def _percentile(percentiles: dict, wanted: float) -> float:
    """The value at percentile `wanted`; keys are strings like "99.000000"."""
    for key, value in percentiles.items():
        try:
            if abs(float(key) - wanted) < 1e-9:
                return float(value)
        except ValueError:
            continue
    return 0.0


def _clat(direction: dict) -> ClatStats:
    """Completion latency in ns from `clat_ns` (absent when the direction did no I/O)."""
    clat = direction.get("clat_ns")
    if clat is None:
        return ClatStats()
    percentiles = clat.get("percentile") or {}
    return ClatStats(mean_ns=float(clat.get("mean", 0.0)), p50_ns=_percentile(percentiles, 50.0),
                     p99_ns=_percentile(percentiles, 99.0), p999_ns=_percentile(percentiles, 99.9))


@dataclass(frozen=True)
class _Direction:
    bw_bytes: float
    iops: float
    io_bytes: float
    ios: float
    clat: ClatStats


def _direction(direction: dict | None) -> _Direction:
    """One direction (`read` or `write`) of one job entry."""
    if not direction:
        return _Direction(0.0, 0.0, 0.0, 0.0, ClatStats())
    iops = float(direction.get("iops", 0.0))
    return _Direction(bw_bytes=float(direction["bw_bytes"]), iops=iops, io_bytes=float(direction.get("io_bytes", 0)),
                      ios=float(direction.get("total_ios", iops)), clat=_clat(direction))


def _combine(parts: list[_Direction]) -> _Direction:
    """Several job entries (a report without group_reporting) as one: bandwidth and IOPS add up;
    the mean is weighted by I/O count; each percentile is the largest of the parts (an upper bound)."""
    if len(parts) == 1:
        return parts[0]
    ios = sum(p.ios for p in parts)
    mean = sum(p.clat.mean_ns * p.ios for p in parts) / ios if ios else 0.0
    clat = ClatStats(mean_ns=mean, p50_ns=max(p.clat.p50_ns for p in parts),
                     p99_ns=max(p.clat.p99_ns for p in parts), p999_ns=max(p.clat.p999_ns for p in parts))
    return _Direction(bw_bytes=sum(p.bw_bytes for p in parts), iops=sum(p.iops for p in parts),
                      io_bytes=sum(p.io_bytes for p in parts), ios=ios, clat=clat)


def parse_fio_json(job: FioJob, text: str, fio_version: str = "") -> FioResult:
    """The normalised result of fio 3's JSON report in `text` (surrounding text ignored).

    `fio_version` is used only when the report does not name its version.
    """
    report = extract_report(text)
    entries = report["jobs"]
    if not entries:
        raise FioError(f"fio job {job.name!r}: the JSON report lists no jobs")
    try:
        read = _combine([_direction(e.get("read")) for e in entries])
        write = _combine([_direction(e.get("write")) for e in entries])
    except KeyError as exc:
        version = report.get("fio version") or fio_version or "unknown"
        raise FioError(f"fio job {job.name!r}: expected fio 3's JSON report, found no {exc} in a report of "
                       f"fio version {version} (install fio >= 3)") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise FioError(f"fio job {job.name!r}: unexpected JSON report layout ({exc})") from None
    busy = read if read.io_bytes >= write.io_bytes else write
    return FioResult(
        job=job, read_bw_bytes=read.bw_bytes, write_bw_bytes=write.bw_bytes, read_iops=read.iops,
        write_iops=write.iops, clat_p99_ns=busy.clat.p99_ns, raw=report, clat_mean_ns=busy.clat.mean_ns,
        clat_p50_ns=busy.clat.p50_ns, clat_p999_ns=busy.clat.p999_ns, read_clat=read.clat, write_clat=write.clat,
        fio_version=str(report.get("fio version") or fio_version),
        error=max(int(e.get("error", 0) or 0) for e in entries),
    )


# --------------------------------------------------------------------------- checks before running


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int | None:
    """Bytes in a fio size such as "8M", "4k", "1GiB", "1000T" or "12345"; None when not a plain size
    (a percentage, a range). Every unit is read as a power of 1024, fio's default (`kb_base=1024`)."""
    match = _SIZE.match(str(text))
    if match is None:
        return None
    number, unit = match.groups()
    return int(float(number) * 1024 ** " kmgtpe".index(unit.lower() or " "))


def fio_version(fio_binary: str = "fio") -> str:
    """fio's version string; raises FioError when fio is not installed."""
    path = shutil.which(fio_binary)
    if path is None:
        raise FioError(f"fio not found on PATH (install Debian's 'fio' package); looked for {fio_binary!r}")
    return subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def ensure_writable_directory(directory: str | os.PathLike) -> Path:
    """Create `directory` if needed and prove a file can be created in it; FioError otherwise."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvgate-probe-"):
            pass
    except OSError as exc:
        raise FioError(f"fio directory {str(path)!r} is not a writable directory: {exc.strerror or exc}") from None
    return path


def _existing_bytes(job: FioJob) -> int:
    """Bytes of this job's data files already in its directory (fio names them `<name>.<job>.<file>`)."""
    total = 0
    with os.scandir(job.directory) as entries:
        for entry in entries:
            if entry.name.startswith(f"{job.name}.") and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def check_free_space(job: FioJob) -> None:
    """FioError when the job's files (size × numjobs, less what is already laid out) exceed the free space."""
    per_job = parse_size(job.size) if job.size is not None else None
    if per_job is None or any(arg.startswith("--filename") for arg in job.extra):
        return  # a relative size or an explicit file/device: nothing to compare against
    needed = per_job * job.numjobs - _existing_bytes(job)
    free = shutil.disk_usage(job.directory).free
    if needed > free:
        raise FioError(
            f"fio job {job.name!r} needs {format_size(needed)} (size {job.size} x {job.numjobs} jobs) in "
            f"{job.directory} but only {format_size(free)} of free space is left there")


# --------------------------------------------------------------------------- running


# glibc's malloc asks for transparent huge pages for its large blocks, fio's I/O buffers among them. An
# O_DIRECT request lands in the job's buffer, and a request can span only so many separate pieces of
# memory (a queue's max_segments: 254 on the development VM's virtio disk, ~1 MiB of 4 KiB pages);
# there, fio's direct 16 MiB QD4 read made 0.65-1.95 MiB requests at 0.64-1.23 GB/s with 4 KiB pages
# and 3.56-4.00 MiB requests at 1.68-2.30 GB/s with huge pages. The storage's best is measured with
# the buffers that let it be reached (the cache's own buffers are huge-page backed too,
# cache_impl/platform/buffers.py). Where glibc lacks the tunable (before 2.35) or THP is off it changes nothing.
FIO_MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"


def fio_environment() -> dict[str, str]:
    """The environment fio runs in: ours, with glibc's huge-page tunable added to any already set."""
    env = dict(os.environ)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    env["GLIBC_TUNABLES"] = ":".join([*tunables, FIO_MALLOC_TUNABLE])
    return env


def run_fio(job: FioJob, fio_binary: str = "fio", timeout_s: float = 600) -> FioResult:
    """Run one job and return its normalised result.

    Raises FioError when fio is missing, the directory is not writable, the
    files do not fit, fio times out or fails, or its output is not a JSON
    report. A verify job whose check fails does not raise: its result has
    `verify_ok=False` and fio's error output in `verify_errors`.
    """
    version = fio_version(fio_binary)
    if not job.read_only:
        ensure_writable_directory(job.directory)
        check_free_space(job)
    try:
        proc = subprocess.run(job.argv(fio_binary), capture_output=True, text=True, timeout=timeout_s, check=False,
                              env=fio_environment())
    except subprocess.TimeoutExpired:
        raise FioError(f"fio job {job.name!r} did not finish within {timeout_s} s") from None
    if proc.returncode != 0 and not job.verify:
        raise FioError(f"fio job {job.name!r} failed (exit {proc.returncode}): {_fio_messages(proc)[-500:]}")
    try:
        result = parse_fio_json(job, proc.stdout, fio_version=version)
    except FioError as exc:
        raise FioError(f"fio job {job.name!r} (exit {proc.returncode}): {exc}; "
                       f"stderr: {proc.stderr.strip()[-500:]}") from None
    if job.verify:
        ok = proc.returncode == 0 and result.error == 0
        result = replace(result, verify_ok=ok, verify_errors="" if ok else _verify_errors(proc))
    return result


def _fio_messages(proc: subprocess.CompletedProcess) -> str:
    """fio's error output and the lines it printed around its JSON on stdout (it puts some errors there)."""
    return "\n".join(part for part in (proc.stderr.strip(), text_around_report(proc.stdout)) if part)


def _verify_errors(proc: subprocess.CompletedProcess) -> str:
    """fio's complaint about a failed verify: its messages, with the exit status."""
    return f"fio exit status {proc.returncode}: {_fio_messages(proc)[-2000:]}"


def _new_data_files(job: FioJob, before: set[str]) -> list[Path]:
    """fio data files of `job` that were not in its directory before it ran."""
    if not job.directory.is_dir():
        return []
    return [p for p in job.directory.iterdir()
            if p.name.startswith(f"{job.name}.") and p.name not in before and p.is_file()]


def run_matrix(matrix: FioMatrix, directory: str | os.PathLike, fio_binary: str = "fio",
               timeout_s: float = 600) -> list[FioResult]:
    """Run every job of `matrix` in `directory`, one after another; each job's data files are removed
    after it ran (also when it failed), and the directory too when this call created it and it is empty."""
    directory = Path(directory)
    created = not directory.exists()
    results = []
    try:
        for job in matrix.jobs(directory):
            before = set(os.listdir(directory)) if directory.is_dir() else set()
            try:
                results.append(run_fio(job, fio_binary=fio_binary, timeout_s=timeout_s))
            finally:
                for path in _new_data_files(job, before):
                    path.unlink(missing_ok=True)
    finally:
        if created and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
    return results


# --------------------------------------------------------------------------- tables


FRAME_COLUMNS = ["name", "rw", "bs", "iodepth", "numjobs", "direct", "read_gbps", "write_gbps", "read_iops",
                 "write_iops", "iops", "clat_p50_ns", "clat_p99_ns", "verify_ok", "fio_version"]


def results_frame(results: list[FioResult]) -> pd.DataFrame:
    """One row per job: its settings, read/write GB/s (10^9 bytes/s), IOPS and busier-direction
    completion latency p50/p99 in ns, in the order of `FRAME_COLUMNS`."""
    import pandas as pd  # deferred: pandas takes a second to import, only for the frame

    rows = [{
        "name": r.job.name, "rw": r.job.rw, "bs": r.job.bs, "iodepth": r.job.iodepth, "numjobs": r.job.numjobs,
        "direct": r.job.direct, "read_gbps": r.read_bw_bytes / 1e9, "write_gbps": r.write_bw_bytes / 1e9,
        "read_iops": r.read_iops, "write_iops": r.write_iops, "iops": r.iops, "clat_p50_ns": r.clat_p50_ns,
        "clat_p99_ns": r.clat_p99_ns, "verify_ok": r.verify_ok, "fio_version": r.fio_version,
    } for r in results]
    return pd.DataFrame(rows, columns=FRAME_COLUMNS)
