"""fio: its JSON (fio 3.33, with text around it) normalised to one result, fio 2.x refused; real runs;
clear errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from workloads.storage.fio import (
    ClatStats,
    FioError,
    FioJob,
    FioMatrix,
    FioPattern,
    FioResult,
    extract_report,
    parse_fio_json,
    parse_size,
    results_frame,
    run_fio,
    run_matrix,
    text_around_report,
    verify_job,
)

DATA = Path(__file__).parents[1] / "data" / "fio"
needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")


def _job(rw="read", bs="1M") -> FioJob:
    return FioJob(name="fixture", directory=Path("/nonexistent"), rw=rw, bs=bs)


def _parse(fixture: str, rw="read") -> FioResult:
    return parse_fio_json(_job(rw), (DATA / fixture).read_text())


# ----------------------------------------------------------------------------- parsing fixtures


def test_fio_3_seq_read_json_normalises_to_bytes_per_second_and_ns_percentiles():
    r = _parse("fio-3.33-seqread.json")
    assert r.fio_version == "fio-3.33"
    assert (r.read_bw_bytes, r.write_bw_bytes) == (729444173.0, 0.0)
    assert (r.read_iops, r.write_iops, r.iops) == (695.652174, 0.0, 695.652174)
    assert r.read_clat == ClatStats(mean_ns=1414982.75, p50_ns=1400832.0, p99_ns=2211840.0, p999_ns=2211840.0)
    assert r.write_clat == ClatStats()  # no writes: no percentiles in fio's JSON, all zero here
    assert (r.clat_mean_ns, r.clat_p50_ns, r.clat_p99_ns, r.clat_p999_ns) == (1414982.75, 1400832.0, 2211840.0,
                                                                             2211840.0)
    assert r.error == 0 and r.verify_ok is None


def test_fio_3_randrw_70_30_json_reports_both_directions_and_read_latency_on_top():
    r = _parse("fio-3.33-randrw70.json", rw="randrw")
    assert (r.read_bw_bytes, r.write_bw_bytes) == (81969102.0, 34883516.0)
    assert (r.read_iops, r.write_iops) == (20011.988012, 8516.483516)
    assert r.read_clat == ClatStats(mean_ns=106899.661392, p50_ns=66048.0, p99_ns=350208.0, p999_ns=1089536.0)
    assert r.write_clat == ClatStats(mean_ns=131582.790029, p50_ns=96768.0, p99_ns=448512.0, p999_ns=1384448.0)
    # reads moved more bytes (70%), so the headline latency is the reads'
    assert (r.clat_p50_ns, r.clat_p99_ns, r.clat_p999_ns) == (66048.0, 350208.0, 1089536.0)


def test_warnings_printed_before_the_json_do_not_change_the_parsed_figures():
    text = (DATA / "fio-3.33-seqread-with-warnings.txt").read_text()
    assert text.startswith("note: both iodepth >= 1")
    with_warnings = parse_fio_json(_job(), text)
    clean = _parse("fio-3.33-seqread.json")
    assert with_warnings.raw == clean.raw
    assert (with_warnings.read_bw_bytes, with_warnings.read_iops, with_warnings.read_clat) == (
        729444173.0, 695.652174, ClatStats(mean_ns=1414982.75, p50_ns=1400832.0, p99_ns=2211840.0,
                                           p999_ns=2211840.0))


def test_text_printed_after_the_json_is_ignored_too():
    text = (DATA / "fio-3.33-seqread.json").read_text() + "\nfio: file hash not empty on exit\n"
    assert parse_fio_json(_job(), text).read_bw_bytes == 729444173.0


def test_a_fio_2_report_is_refused_naming_its_version_not_misread():
    # fio 2.x reports bandwidth only as `bw` in KiB/s and latency as `clat` in microseconds
    with pytest.raises(FioError, match="expected fio 3's JSON report.*'bw_bytes'.*fio-2.2.10.*fio >= 3"):
        _parse("fio-2.2.10-randrw70-handwritten.json", rw="randrw")


def test_report_without_group_reporting_adds_bandwidth_and_takes_the_largest_percentile():
    report = extract_report((DATA / "fio-3.33-seqread.json").read_text())
    second = json.loads(json.dumps(report["jobs"][0]))
    second["read"]["clat_ns"]["percentile"]["99.000000"] = 3000000
    report["jobs"].append(second)
    r = parse_fio_json(_job(), json.dumps(report))
    assert r.read_bw_bytes == 2 * 729444173.0
    assert r.read_iops == 2 * 695.652174
    assert r.clat_p99_ns == 3000000.0
    assert r.clat_mean_ns == pytest.approx(1414982.75)


def test_text_around_the_report_is_kept_for_error_messages():
    text = (DATA / "fio-3.33-seqread-with-warnings.txt").read_text() + "trailing line\n"
    around = text_around_report(text)
    assert around.splitlines()[0].startswith("note: both iodepth >= 1")
    assert around.splitlines()[-1] == "trailing line" and "fio version" not in around


def test_output_without_a_json_report_raises_fio_error_quoting_the_output():
    with pytest.raises(FioError, match="not fio's JSON report.*Laying out"):
        parse_fio_json(_job(), "seqread: Laying out IO file (1 file / 16MiB)\n")


@pytest.mark.parametrize("text, expected", [
    ("8M", 8 * 2**20), ("4k", 4096), ("1GiB", 2**30), ("1000T", 1000 * 2**40), ("12345", 12345), (4096, 4096),
    ("50%", None), ("4k-8k", None),
])
def test_parse_size_reads_fio_sizes_in_powers_of_1024(text, expected):
    assert parse_size(text) == expected


# ----------------------------------------------------------------------------- jobs as data


def test_default_matrix_has_seq_1m_random_4k_and_mixed_70_30_jobs(tmp_path):
    jobs = FioMatrix().jobs(tmp_path)
    assert [(j.rw, j.bs, j.rwmixread) for j in jobs] == [
        ("read", "1M", None), ("write", "1M", None), ("randread", "4k", None), ("randwrite", "4k", None),
        ("randrw", "4k", 70)]
    assert "--rwmixread=70" in jobs[-1].argv()
    assert all(j.directory == tmp_path and j.ioengine == "libaio" and j.direct for j in jobs)


def test_matrix_settings_reach_every_job_and_verify_adds_a_crc32c_job(tmp_path):
    matrix = FioMatrix(size="8M", runtime_s=1.5, iodepth=4, numjobs=2, direct=False, ioengine="psync", verify=True)
    jobs = matrix.jobs(tmp_path)
    assert len(jobs) == 6
    for job in jobs[:-1]:
        argv = job.argv()
        for arg in ("--size=8M", "--iodepth=4", "--numjobs=2", "--direct=0", "--ioengine=psync", "--runtime=1500ms",
                    "--time_based"):
            assert arg in argv
    verify_argv = jobs[-1].argv()
    assert {"--rw=write", "--verify=crc32c", "--do_verify=1", "--size=8M"} <= set(verify_argv)
    assert not any(a.startswith("--runtime") for a in verify_argv)  # a time-based verify would never check


def test_matrix_rejects_bad_settings_naming_the_field():
    with pytest.raises(ValueError, match="FioMatrix.iodepth"):
        FioMatrix(iodepth=0)
    with pytest.raises(ValueError, match="rwmixread"):
        FioMatrix(patterns=(FioPattern("mix", "randrw", "4k", rwmixread=170),))


def test_argv_keeps_the_leading_options_cache_bench_prints():
    argv = FioJob(name="seqread", directory=Path("/d"), rw="read", bs="1M", size="8M", direct=True, numjobs=2,
                  extra=("--nrfiles=2",)).argv()
    assert argv[3:11] == ["--rw=read", "--bs=1M", "--size=8M", "--direct=1", "--ioengine=psync", "--iodepth=1",
                          "--numjobs=2", "--group_reporting"]
    assert argv[-1] == "--nrfiles=2"


# ----------------------------------------------------------------------------- real fio


@needs_fio
def test_default_matrix_with_tiny_sizes_runs_every_job_and_cleans_up(tmp_path):
    target = tmp_path / "fio"
    matrix = FioMatrix(size="8M", runtime_s=0.5, iodepth=4)
    results = run_matrix(matrix, target)
    assert [r.job.name for r in results] == [p.name for p in matrix.patterns]
    for r in results:
        moved_bw = r.read_bw_bytes + r.write_bw_bytes
        assert moved_bw > 0 and r.iops > 0 and r.clat_p50_ns > 0, r.job.name
        assert r.fio_version.startswith("fio-")
    seq_read, seq_write, _, _, mixed = results
    assert seq_read.read_bw_bytes > 0 and seq_read.write_bw_bytes == 0
    assert seq_write.write_bw_bytes > 0 and seq_write.read_bw_bytes == 0
    assert mixed.read_iops > mixed.write_iops > 0
    frame = results_frame(results)
    assert len(frame) == len(matrix.patterns)
    assert list(frame["name"]) == [p.name for p in matrix.patterns]
    assert (frame["read_gbps"] + frame["write_gbps"] > 0).all() and (frame["iops"] > 0).all()
    assert not target.exists()  # data files removed, and the directory run_matrix created


@needs_fio
def test_run_matrix_leaves_files_it_did_not_create(tmp_path):
    keep = tmp_path / "seq-read.keep"
    keep.write_bytes(b"x")
    run_matrix(FioMatrix(patterns=(FioPattern("seq-read", "read", "1M"),), size="4M", runtime_s=None,
                         ioengine="psync", iodepth=1), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seq-read.keep"]


@needs_fio
def test_verify_pass_on_good_storage_reports_verify_ok(tmp_path):
    result = run_fio(verify_job(tmp_path, size="8M"))
    assert result.verify_ok is True and result.verify_errors == ""
    assert result.write_bw_bytes > 0 and result.read_bw_bytes > 0  # wrote, then read back to check
    frame = results_frame([result])
    assert bool(frame.loc[0, "verify_ok"]) is True


@needs_fio
def test_verify_of_data_without_checksums_reports_fio_verify_errors(tmp_path):
    job = verify_job(tmp_path, size="4M")
    (tmp_path / f"{job.name}.0.0").write_bytes(b"\x5a" * (4 * 2**20))  # not what fio wrote: no verify headers
    bad = replace(job, extra=("--verify_only=1",))
    result = run_fio(bad)
    assert result.verify_ok is False
    assert result.verify_errors.startswith("fio exit status 1")
    assert "verify: bad magic header" in result.verify_errors  # fio's stderr
    assert "err=84" in result.verify_errors                     # fio's per-job error line, printed on stdout


@needs_fio
def test_run_fio_lays_out_files_that_fit_even_when_earlier_files_exist(tmp_path):
    job = FioJob(name="seqread", directory=tmp_path, rw="read", bs="1M", size="4M")
    first, second = run_fio(job), run_fio(job)  # the second run reuses the laid-out file
    assert first.read_bw_bytes > 0 and second.read_bw_bytes > 0


# ----------------------------------------------------------------------------- errors


def test_missing_fio_binary_raises_fio_error_naming_fio(tmp_path):
    job = FioJob(name="seqread", directory=tmp_path / "d", rw="read", size="4M")
    with pytest.raises(FioError, match="fio not found.*no-such-fio-binary"):
        run_fio(job, fio_binary="no-such-fio-binary")
    with pytest.raises(FioError, match="fio not found"):
        run_matrix(FioMatrix(size="4M"), tmp_path / "m", fio_binary="no-such-fio-binary")
    assert not (tmp_path / "d").exists() and not (tmp_path / "m").exists()


@needs_fio
def test_directory_under_a_regular_file_raises_fio_error_saying_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    job = FioJob(name="seqread", directory=blocker / "fio", rw="read", size="4M")
    with pytest.raises(FioError, match="not a writable directory"):
        run_fio(job)


@needs_fio
def test_size_beyond_free_space_raises_fio_error_mentioning_free_space(tmp_path):
    job = FioJob(name="seqread", directory=tmp_path, rw="read", size="1000T", numjobs=2)
    with pytest.raises(FioError, match="free space") as info:
        run_fio(job)
    assert "1000T x 2 jobs" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # refused before fio laid anything out


def test_fio_runs_with_glibcs_huge_page_tunable_added_to_the_users_own(monkeypatch):
    from workloads.storage.fio import FIO_MALLOC_TUNABLE, fio_environment

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0")
    env = fio_environment()
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{FIO_MALLOC_TUNABLE}"   # theirs kept, ours wins
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert fio_environment()["GLIBC_TUNABLES"] == FIO_MALLOC_TUNABLE
