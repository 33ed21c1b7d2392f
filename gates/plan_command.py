"""`kvgate plan`: the sizing model from the command line.

    kvgate plan [--config FILE] [--profile quick|full] [--from RUN_DIR] [--calibration FILE] [--json]
    kvgate plan --calibrate RUN_DIR [--out FILE]

`--from RUN_DIR` refines the plan with that run's figures (G1's fio, G2's recompute curve and hit
costs, G3's decode cost: fitted by calibration.py; its machine probe for what it did not measure);
`--calibrate` fits those constants and writes them to a file that `--calibration` reads later, for a plan
before any run on the machine under test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gates.config import load_config
from kvcore.rundata import RunStore
from kvcore.settings import ConfigError
from sizing.calibration import Calibration, calibrate
from sizing.machine import run_probe_calibration
from sizing.plan import make_plan, render_text
from sizing.targets import target_inputs

DEFAULT_CALIBRATION = Path("kvgate-calibration.json")


def add_plan(commands) -> None:
    plan = commands.add_parser(
        "plan", help="the sizing model: each gate's figures predicted, with the verdict they would get",
        description="Predict each gate's figures from the config: the model's KV layout, the tiers' "
                    "capacities and bandwidths, the workload's hits per tier (replayed through the cache's "
                    "own placement rules) and the recompute curve. --from RUN_DIR refines it with a run's "
                    "measurements; --calibrate RUN_DIR writes the fitted constants for later plans.")
    plan.add_argument("--config", type=Path, help="gates.yaml (default: the profile's defaults)")
    plan.add_argument("--profile", choices=["quick", "full"], help="defaults under the config (default: quick)")
    plan.add_argument("--from", dest="from_run", type=Path, metavar="RUN_DIR",
                      help="a run directory whose G1/G2/G3 figures the plan uses")
    plan.add_argument("--calibration", type=Path, metavar="FILE", help="constants written by --calibrate "
                      "(default: the config's sizing.calibration)")
    plan.add_argument("--calibrate", type=Path, metavar="RUN_DIR",
                      help="fit the constants to a run and write them (--out), then stop")
    plan.add_argument("--out", type=Path, default=DEFAULT_CALIBRATION,
                      help=f"where --calibrate writes (default: {DEFAULT_CALIBRATION})")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(handler=run_plan)


def _run_dir(path: Path, option: str) -> RunStore:
    if not (path / "run.json").exists():
        raise ConfigError(f"{option}: expected a run directory (with run.json), found {path}")
    return RunStore(path)


def run_plan(args: argparse.Namespace) -> int:
    config = load_config(args.config, profile=args.profile)
    if args.calibrate is not None:
        measured = _run_dir(args.calibrate, "--calibrate")
        fitted = calibrate(measured.root, kv_bytes_per_token=target_inputs(config)[0].shape.bytes_per_token)
        if not fitted.fitted():
            raise ConfigError(f"--calibrate: expected a run with measurements to fit (G2's TTFTs, G3's records, "
                              f"the storage's ratios), found none in {args.calibrate}")
        try:
            fitted.save(args.out)
        except OSError as error:
            raise ConfigError(f"--out: expected a file kvgate can write, found {str(args.out)!r} refused "
                              f"({error.strerror or error})") from None
        print(f"kvgate plan: wrote {args.out} (constants fitted to {args.calibrate})"
              + "".join(f"\n  note: {note}" for note in fitted.notes))
        return 0
    config.check_g2_contexts()   # the plan predicts G2 at these contexts
    store = _run_dir(args.from_run, "--from") if args.from_run is not None else None
    given = args.calibration if args.calibration is not None else config.sizing.calibration   # the flag wins
    calibration = Calibration.load(given) if given is not None else None
    plan = make_plan(config, store, calibration, machine=run_probe_calibration(store) if store is not None else None)
    print(json.dumps(plan.to_dict(), indent=2, default=str) if args.json else render_text(plan))
    return 0
