"""The `kvgate` command line. Exit codes: 0 success, 1 a check failed, 2 usage or configuration error."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from cache_impl.config import ConfigError
from workloads.fio import FioError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser(
        "cache-bench", help="cache tier figures against fio and memcpy on this machine",
        description="Measure the disk tier against fio, the host tier against memcpy, and prefix lookup.",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bench.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                       help="directory on the storage to measure (default: %(default)s)")
    bench.add_argument("--prefix-mib", type=_positive_int, default=256, help="size of the cached prefix (default: 256)")
    bench.add_argument("--rounds", type=_positive_int, default=5, help="back-to-back rounds per comparison (default: 5)")
    bench.add_argument("--read-workers", type=_positive_int, default=4, help="disk tier read threads (default: 4)")
    bench.add_argument("--indexed-blocks", type=_positive_int, default=1_000_000,
                       help="blocks in the index for the lookup figure (default: 1000000)")
    bench.set_defaults(handler=_cache_bench)
    return parser


def _cache_bench(args: argparse.Namespace) -> int:
    from .cache_bench import BenchSettings, format_report, run_cache_bench

    figures = run_cache_bench(BenchSettings(
        directory=args.dir, prefix_mib=args.prefix_mib, rounds=args.rounds, read_workers=args.read_workers,
        indexed_blocks=args.indexed_blocks,
    ))
    print(json.dumps(figures, indent=2) if args.json else format_report(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, FioError) as error:
        print(f"kvgate: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
