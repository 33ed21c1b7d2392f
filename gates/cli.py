"""The `kvgate` command line. Exit codes: 0 success, 1 a check failed, 2 usage or configuration error."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from cache_impl.cache import blockfiles
from cache_impl.cache.config import DEFAULT_READ_WORKERS, ConfigError
from cache_impl.cache.scrub import scrub
from cache_impl.engine.presets import MAX_WEIGHTS_SEED
from cache_impl.server.serve_command import SERVE_DESCRIPTION, SERVE_HELP, add_serve_arguments, load_yaml_section
from cache_impl.weights.safetensors_dir import CheckpointFormatError
from kvcore.printable import printable
from kvcore.rundata import RunStore
from kvcore.settings import load_yaml_mapping
from workloads.storage.fio import FioError

from .benches.client_bench import ClientBenchSettings, format_client_report, run_client_bench
from .config import load_config
from .plan_command import add_plan
from .run import GateRunner, available_gates, check_creatable_dir, check_resume, check_storage_path, new_run_dir
from .run_claim import claim_run_dir
from .selftest import controls_for, run_selftest
from .template import render_template


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    return value


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, found {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, found {text}")
    return value


def _bench_parser(commands, name: str, help_text: str, description: str, dir_help: str) -> argparse.ArgumentParser:
    """A benchmark subcommand with the options every benchmark has: --json and --dir."""
    bench = commands.add_parser(name, help=help_text, description=description)
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bench.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help=dir_help)
    return bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_run(commands)
    bench = _bench_parser(
        commands,
        "cache-bench",
        "cache tier figures against the storage's best and memcpy on this machine",
        "Measure the disk tier against the storage's best (a quick fio sweep), the host tier against memcpy, "
        "and prefix lookup.",
        "directory on the storage to measure (default: %(default)s)",
    )
    bench.add_argument("--prefix-mib", type=_positive_int, default=256, help="size of the cached prefix (default: 256)")
    bench.add_argument("--rounds", type=_positive_int, default=8,
                       help="back-to-back rounds per comparison, their order alternating (default: 8)")
    bench.add_argument("--read-workers", type=_positive_int, default=DEFAULT_READ_WORKERS,
                       help=f"disk tier read threads, its queue depth (default: {DEFAULT_READ_WORKERS})")
    bench.add_argument("--block-mib", type=_positive_int, default=2,
                       help="the bench layout's block size in MiB (1: the small preset's; 64: near a 70B model's "
                            "80 MiB block) (default: 2)")
    bench.add_argument("--indexed-blocks", type=_positive_int, default=1_000_000,
                       help="blocks in the index for the lookup figure (default: 1000000)")
    bench.add_argument("--sweep-mib", type=_positive_int, default=512,
                       help="bytes each point of the quick storage sweep reads, for the storage's best (default: 512)")
    bench.set_defaults(handler=_cache_bench)
    _add_serve(commands)
    _add_export_weights(commands)
    _add_scrub(commands)
    _add_engine_bench(commands)
    add_plan(commands)
    _add_client_bench(commands)
    _add_pool_bench(commands)
    _add_selftest(commands)
    return parser


def _gate_name(text: str) -> str:
    if text.lower() not in ("g1", "g2", "g3", "g4"):
        raise argparse.ArgumentTypeError(f"expected a gate name g1, g2, g3 or g4, found {text!r}")
    return text.lower()


def _add_run(commands) -> None:
    run = commands.add_parser(
        "run", help="run the acceptance gates in order (stop-loss) and write the report",
        description="Run gates G1-G4 in order; a failed gate stops the later ones unless --continue-on-fail. "
                    "Exit 0: all passed; 1: a gate failed or was inconclusive; 2: usage or configuration error.",
    )
    run.add_argument("gates", nargs="*", type=_gate_name, help="gates to run (default: every available gate)")
    run.add_argument("--config", type=Path, help="gates.yaml (default: the profile's defaults, embedded target)")
    run.add_argument("--profile", choices=["quick", "full"], help="defaults under the config (default: quick)")
    run.add_argument("--out", type=Path, help="the run directory (default: reports/runs/<run-id>)")
    run.add_argument("--trace", type=Path, metavar="FILE",
                     help="the trace file (JSONL) of a trace workload (g3/g4.workload.kind: trace)")
    run.add_argument("--continue-on-fail", action="store_true", help="run the later gates after a failure")
    run.add_argument("--aa", action="store_true",
                     help="A/A: each subject against itself (G3's baseline role is the candidate; G2's pairs put the "
                          "storage's best job on both sides) and report how many intervals excluded the null: the "
                          "harness's own false decisions")
    run.add_argument("--resume", type=Path, metavar="RUN_DIR",
                     help="continue a run whose harness was killed (its config and completed soak windows are kept)")
    run.set_defaults(handler=_run)

    init = commands.add_parser("init", help="write a commented gates.yaml template")
    init.add_argument("file", nargs="?", type=Path, default=Path("gates.yaml"), help="where (default: gates.yaml)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(handler=_init)

    report = commands.add_parser("report", help="render a run directory's report again (also mid-run)")
    report.add_argument("run_dir", type=Path, help="the run directory")
    report.set_defaults(handler=_report)


def _run(args: argparse.Namespace) -> int:
    if args.resume is not None:
        if args.config or args.out or args.trace:
            raise ConfigError("--resume: expected no --config, --out or --trace (the run directory has them), "
                              "found them")
        if not (args.resume / "run.json").exists() or not (args.resume / "config.yaml").exists():
            raise ConfigError(f"--resume: expected a run directory with run.json and config.yaml, found {args.resume}")
    try:
        config = load_config(args.resume / "config.yaml" if args.resume else args.config, args.profile, args.trace)
    except ConfigError as error:    # a run directory's own config: said with its file, which the user did not write
        if args.resume is None or str(args.resume / "config.yaml") in str(error):
            raise
        raise ConfigError(f"--resume: the run's {args.resume / 'config.yaml'} does not load: {error}") from None
    if args.aa:
        config = config.model_copy(update={"aa": True})
    known = available_gates()
    gates = args.gates or (["g4"] if args.resume else known)
    missing = [g for g in gates if g not in known]
    if missing:
        raise ConfigError(f"gates: expected some of {known} (the suites this version has), found {missing}")
    ordered = [g for g in ("g1", "g2", "g3", "g4") if g in gates]
    if config.aa and not {"g2", "g3"} & set(ordered):
        raise ConfigError(f"--aa: expected a gate with side-by-side figures to run against itself (g2, g3), found "
                          f"{' '.join(ordered)}")
    if "g2" in ordered:
        config.check_g2_contexts()
    if args.resume is not None:
        check_resume(args.resume, ordered)

        run_id = RunStore(args.resume).run_info().get("run_id", args.resume.name)
        run_dir = args.resume
    else:
        run_id, run_dir = new_run_dir(args.out)
    check_storage_path(config.storage.path)
    resume = args.resume is not None
    with claim_run_dir(run_dir, run_id, "--resume" if resume else "--out", new=not resume):
        return GateRunner(config, run_dir, run_id, ordered, args.continue_on_fail, resume=resume).run()


def _init(args: argparse.Namespace) -> int:
    if args.file.exists() and not args.force:
        print(f"kvgate init: {args.file} exists (use --force to overwrite)", file=sys.stderr)
        return 2
    try:
        args.file.write_text(render_template())
    except OSError as error:
        raise ConfigError(f"file: expected a path kvgate can write, found {str(args.file)!r}: "
                          f"{error.strerror or error}") from None
    print(f"wrote {args.file}: edit it, then `kvgate run --config {args.file}`")
    return 0


def _report(args: argparse.Namespace) -> int:
    from reports.render import render_run  # deferred: the renderer imports matplotlib (seconds), for kvgate report only

    if not (args.run_dir / "run.json").exists():
        print(f"kvgate report: run_dir: expected a run directory with run.json, found {args.run_dir}", file=sys.stderr)
        return 2
    results = render_run(args.run_dir)
    print(f"{results['overall']['status'].upper()}: {printable(results['overall']['summary'])}")
    print(f"report: {(args.run_dir / 'index.html').resolve()}")
    return 0


def _add_serve(commands) -> None:
    serve = commands.add_parser("serve", help=SERVE_HELP, description=SERVE_DESCRIPTION)
    add_serve_arguments(serve)


def _add_export_weights(commands) -> None:
    export = commands.add_parser(
        "export-weights", help="write the embedded model's weights as a safetensors directory",
        description="Write the seeded embedded model's weights the way models ship: model-0000i-of-0000N."
                    "safetensors shards, model.safetensors.index.json and a checksum sidecar; the metadata "
                    "names the preset, so `kvgate serve --weights DIR` needs no --preset.",
    )
    export.add_argument("dir", type=Path, help="the directory to write (created; refused if it holds a checkpoint)")
    export.add_argument("--preset", default="small", help="model size preset: tiny, small, base (default: small)")
    export.add_argument("--seed", type=int, default=0, help="weights seed (default: 0, as kvgate serve's)")
    export.add_argument("--shard-mib", type=_positive_number, default=512,
                        help="shard size in MiB, fractions allowed (default: 512)")
    export.add_argument("--force", action="store_true", help="replace a checkpoint already in the directory")
    export.add_argument("--format", choices=("kvgate", "hf"), default="kvgate",
                        help="kvgate: shards for `kvgate serve --weights` (default); hf: a Hugging Face Llama "
                             "directory (config, weights, the byte tokenizer and its chat template) that vLLM or "
                             "transformers serve with the same outputs as kvgate serve")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="--format hf: the weights' dtype (default: float32, kvgate serve's)")
    export.set_defaults(handler=_export_weights)


def _export_weights(args: argparse.Namespace) -> int:
    from cache_impl.engine.model import PRESETS  # deferred: torch (seconds), for kvgate export-weights only
    from cache_impl.engine.weights import export_weights  # deferred: torch (seconds), for kvgate export-weights only

    if args.preset not in PRESETS:
        raise ConfigError(f"--preset: expected one of {', '.join(PRESETS)}, found {args.preset!r}")
    if not 0 <= args.seed <= MAX_WEIGHTS_SEED:
        raise ConfigError(f"--seed: expected an integer in 0..{MAX_WEIGHTS_SEED}, found {args.seed}")
    if args.format == "hf":
        from cache_impl.engine.hf_export import export_hf  # deferred: torch (seconds), for kvgate export-weights only

        with _writing(args.dir):
            export_hf(args.dir, args.preset, args.seed, args.dtype, args.force)
        print(f"wrote {args.dir}: preset {args.preset}, seed {args.seed}, {args.dtype}, as a Hugging Face Llama "
              f"(served by vLLM: python -m vllm.entrypoints.openai.api_server --model {args.dir})")
        return 0
    with _writing(args.dir):
        written = export_weights(args.dir, args.preset, args.seed, int(args.shard_mib * 2**20), args.force)
    print(f"wrote {args.dir}: preset {args.preset}, seed {args.seed}, {len(written.tensors)} tensors, "
          f"{written.tensor_bytes / 2**20:.2f} MiB in {len(written.files)} shard(s)")
    return 0


@contextlib.contextmanager
def _writing(directory: Path):
    """An export's errors as configuration errors naming `dir`: not a directory, one already there, one that
    cannot be written. The first is refused before the model is built."""
    if directory.exists() and not directory.is_dir():
        found = "a file" if directory.is_file() else "something other than a directory"
        raise ConfigError(f"dir: expected a directory, found {found}: {directory}")
    try:
        yield
    except FileExistsError as error:
        raise ConfigError(f"dir: {error} (--force replaces it)") from None
    except OSError as error:
        raise ConfigError(f"dir: expected a directory kvgate can write, found {directory} refused "
                          f"({error.strerror or error})") from None


def _add_scrub(commands) -> None:
    scrub = commands.add_parser(
        "scrub", help="verify every stored KV block of the disk tier and remove the bad ones",
        description="Verify every block file in the disk tier directories (header, key, size, checksum) and "
                    "remove the bad ones. Exit 0: all blocks good; 1: bad blocks found (removed unless "
                    "--dry-run); 2: usage or configuration error.",
    )
    scrub.add_argument("--config", type=Path,
                       help="an engine YAML (its engine.cache.disk.path) or a gates.yaml (the embedded targets' "
                            "directories under storage.path)")
    scrub.add_argument("--cache-dir", type=Path, action="append", help="a disk tier directory (repeatable)")
    scrub.add_argument("--dry-run", action="store_true", help="report bad blocks, remove nothing")
    scrub.add_argument("--json", action="store_true", help="print one JSON object per directory")
    scrub.set_defaults(handler=_scrub)


def _scrub_dirs(args: argparse.Namespace) -> list[Path]:
    """The disk tier directories to scrub: --cache-dir, else from --config, else the serve default."""
    from cache_impl.engine.engine import EngineConfig  # deferred: torch (seconds), for kvgate scrub only

    if args.cache_dir:
        return list(args.cache_dir)
    if args.config is None or "engine" in load_yaml_mapping(args.config, str(args.config)):
        engine = EngineConfig.from_dict({} if args.config is None else load_yaml_section(args.config, "engine"))
        if engine.cache.disk is None:
            raise ConfigError(f"{args.config or 'the serve default'}: engine.cache.disk: expected a disk tier to "
                              "scrub, found none")
        return [engine.cache.disk.path]
    storage = Path(load_config(args.config).storage.path)
    return sorted(p for p in storage.glob("kv-*") if p.is_dir()) or [storage / "kv-tiered"]


def _scrub(args: argparse.Namespace) -> int:
    found_bad = False
    for directory in _scrub_dirs(args):
        if not directory.is_dir():
            found = "a file" if directory.exists() else "no such directory"
            print(f"kvgate scrub: --cache-dir: expected a disk tier directory, found {found}: {directory}",
                  file=sys.stderr)
            return 2
        if not blockfiles.is_tier_dir(directory):
            print(f"kvgate scrub: --cache-dir: expected a disk tier's directory (a <fingerprint hex>/ directory of "
                  f"block files in it, which a tier makes when it starts), found none in {directory}", file=sys.stderr)
            return 2
        summary = scrub(directory, remove=not args.dry_run)
        found_bad |= summary.bad > 0
        if args.json:
            print(json.dumps(summary.as_dict()))
            continue
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(summary.bad_by_reason.items())) or "none"
        print(f"{directory}: checked {summary.checked} blocks ({summary.bytes_checked / 2**20:.1f} MiB) "
              f"of {summary.fingerprints} model fingerprint(s); bad {summary.bad} ({reasons}); "
              f"removed {summary.removed}; temp files left alone {summary.temp_files}; "
              f"skipped {summary.skipped} not the tier's own (links are never followed)")
        for path in summary.bad_files[:20]:
            print(f"  bad: {path}")
        for path, why in summary.skipped_files[:20]:
            print(f"  skipped ({why}): {path}")
    return 1 if found_bad else 0


def _contexts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, found {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected token counts >= 2, found {text!r}")
    return tuple(sorted(values))


def _add_engine_bench(commands) -> None:
    bench = _bench_parser(commands, "engine-bench",
                          "single-request TTFT of the embedded engine: recompute vs host and cold disk hits",
                          "TTFT at each context length with nothing cached, a host-tier hit and a cold disk hit.",
                          "disk tier location")
    bench.add_argument("--contexts", type=_contexts, default=(1024, 4096, 8192),
                       help="comma-separated context lengths in tokens (default: 1024,4096,8192)")
    bench.add_argument("--rounds", type=_positive_int, default=3, help="rounds per context (default: 3)")
    bench.add_argument("--preset", default="small", help="model preset (default: small)")
    bench.set_defaults(handler=_engine_bench)


def _engine_bench(args: argparse.Namespace) -> int:
    # deferred: torch (seconds), for kvgate engine-bench only
    from .benches.engine_bench import EngineBenchSettings, format_engine_report, run_engine_bench

    figures = run_engine_bench(EngineBenchSettings(args.dir, args.contexts, args.rounds, args.preset))
    print(json.dumps(figures, indent=2) if args.json else format_engine_report(figures))
    return 0


def _add_pool_bench(commands) -> None:
    bench = _bench_parser(
        commands,
        "pool-bench",
        "the shared pool on Redis and Mooncake Store: bandwidth, cross-node TTFT",
        "Remote-tier load of a cold prefix against a plain client get of the same bytes, and a "
        "node B hit on a prefix node A computed against recompute, per backend.",
        "where the nodes' disk tiers go",
    )
    bench.add_argument("--backends", type=_backends, default=("redis", "mooncake"),
                       help="comma-separated: redis, mooncake (default: both)")
    bench.add_argument("--redis", metavar="URL", help="a running Redis (default: one is started on loopback)")
    bench.add_argument("--mooncake", metavar="URL", help="a running Mooncake pool (default: one is started)")
    bench.add_argument("--prefix-mib", type=_positive_int, default=64, help="cold prefix size (default: 64)")
    bench.add_argument("--context", type=_positive_int, default=8192, help="cross-node prompt tokens (default: 8192)")
    bench.add_argument("--rounds", type=_positive_int, default=5, help="rounds (default: 5)")
    bench.add_argument("--preset", default="small", help="model preset (default: small)")
    bench.set_defaults(handler=_pool_bench)


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names or any(name not in ("redis", "mooncake") for name in names):
        raise argparse.ArgumentTypeError(f"expected redis and/or mooncake, comma-separated, found {text!r}")
    return names


def _pool_bench(args: argparse.Namespace) -> int:
    # deferred: torch (seconds), for kvgate pool-bench only
    from .benches.pool_bench import PoolBenchSettings, format_pool_report, run_pool_bench

    urls = {name: url for name, url in (("redis", args.redis), ("mooncake", args.mooncake)) if url}
    figures = run_pool_bench(PoolBenchSettings(args.dir, args.backends, args.prefix_mib, args.rounds, args.context,
                                               args.preset, urls))
    print(json.dumps(figures, indent=2) if args.json else format_pool_report(figures))
    return 0


def _add_client_bench(commands) -> None:
    bench = _bench_parser(commands, "client-bench", "fidelity and scale of the load engine's measurements",
                          "Our TTFT vs an independent minimal timer on the embedded server, and the TTFT the load "
                          "engine adds at many concurrent streams against a trivial reference server.",
                          "where raw records go")
    bench.add_argument("--streams", type=_positive_int, default=200, help="concurrent streams (default: 200)")
    bench.add_argument("--duration", type=_positive_int, default=20, help="scale run seconds (default: 20)")
    bench.add_argument("--workers", type=int, default=1, help="locust worker processes, 0: one process (default: 1)")
    bench.add_argument("--fidelity-requests", type=_positive_int, default=40, help="requests per client (default: 40)")
    bench.set_defaults(handler=_client_bench)


def _client_bench(args: argparse.Namespace) -> int:
    figures = run_client_bench(ClientBenchSettings(
        directory=args.dir, fidelity_requests=args.fidelity_requests, streams=args.streams,
        scale_duration_s=args.duration, workers=args.workers,
    ))
    print(json.dumps(figures, indent=2) if args.json else format_client_report(figures))
    return 0


def _add_selftest(commands) -> None:
    selftest = commands.add_parser(
        "selftest", help="run known-bad and known-null candidates through the real gates (negative controls)",
        description="Each control (A/A, a serial-read tier, a failing candidate, one better only in invalid steps, "
                    "a drifting server, a leaking one, and a known-good control for each of their checks) runs the "
                    "real gate and prints the verdicts it got beside what it should have got. Exit 0: every control "
                    "behaved; 1: one did not; 2: usage error.",
    )
    selftest.add_argument("--full", action="store_true",
                          help="more levels, longer steps, the kvgate-serve A/A, the direct-I/O tier and "
                               "the embedded default through the quick profile's G3")
    selftest.add_argument("--json", action="store_true", help="print selftest.json instead of one line per control")
    selftest.add_argument("--out", type=Path, help="where each control's run goes (default: reports/runs/"
                                                   "selftest-<time>)")
    selftest.add_argument("--control", action="append", default=[], metavar="KEY",
                          help="run only this control (repeatable), e.g. a-aa-mock")
    selftest.set_defaults(handler=_selftest)


def _selftest(args: argparse.Namespace) -> int:
    try:
        controls = controls_for(args.full, tuple(args.control))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    out = args.out or Path("reports/runs") / time.strftime("selftest-%Y%m%d-%H%M%S")
    check_creatable_dir(out, "--out", "a directory for the controls' runs (new, or one kvgate can write into)")
    profile = "full" if args.full else "quick"
    if not args.json:
        print(f"kvgate selftest {profile}: {len(controls)} controls -> {out}", flush=True)
    suite = run_selftest(controls, profile, out,
                         on_result=(lambda result: None) if args.json else lambda result: print(result.line(),
                                                                                                  flush=True))
    if args.json:
        print(json.dumps(suite.to_dict(), indent=2))
    else:
        wrong = [r.key for r in suite.results if not r.ok]
        print(
            f"selftest: {len(suite.results) - len(wrong)} of {len(suite.results)} controls behaved"
            + (f"; WRONG: {', '.join(wrong)}" if wrong else "")
            + f" ({suite.seconds:.0f} s); {out / 'selftest.json'}"
        )
        # the closing line a CI log reader takes a test runner's count from: a control behaving is a pass
        print(f"selftest: {len(suite.results) - len(wrong)} passed, {len(wrong)} failed")
    return 0 if suite.ok else 1


def _cache_bench(args: argparse.Namespace) -> int:
    # deferred: torch (seconds), for kvgate cache-bench only
    from .benches.cache_bench import BENCH_GRID, BenchSettings, format_report, run_cache_bench

    figures = run_cache_bench(BenchSettings(
        directory=args.dir, prefix_mib=args.prefix_mib, rounds=args.rounds, read_workers=args.read_workers,
        block_mib=args.block_mib, indexed_blocks=args.indexed_blocks,
        sweep=replace(BENCH_GRID, size=f"{args.sweep_mib}M"),
    ))
    print(json.dumps(figures, indent=2) if args.json else format_report(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.handler(args)
        sys.stdout.flush()          # inside the try: a reader that has gone away is met here, not at exit
        return code
    except (ConfigError, FioError, CheckpointFormatError) as error:
        print(f"kvgate {args.command}: {printable(str(error))}", file=sys.stderr)
        return 2
    except BrokenPipeError:      # `kvgate plan | head`: the reader has what it wanted; nothing more to print
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
