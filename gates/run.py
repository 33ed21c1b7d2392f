"""`kvgate run`: the gates in order, with stop-loss, each a pytest suite in its own process.

The runner writes the resolved config and the environment fingerprint into
the run directory, starts the embedded servers (or uses the external URLs),
checks that every target answers (the pre-flight: exit 2 naming the target when one does not),
runs each gate's suite with the gate plugin, prints one line per verdict as it
lands, decides the gate's status from its verdicts, stops the later gates
after a failure (unless --continue-on-fail), and renders the report.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import secrets
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional, Sequence

import yaml
from rich.console import Console

from cache_impl.server.auth import ADMIN_TOKEN_ENV
from kvcore.aa import false_decision_line, false_decisions
from kvcore.outcome import exit_code, overall_status
from kvcore.predictions import beside, beside_text
from kvcore.printable import printable
from kvcore.rundata import GATE_TITLES, RUN_LOCK, RunStore
from kvcore.settings import ConfigError
from sizing.in_run import PREDICTED_GATES, final_sizing, gate_lines, stage_plan
from sizing.machine import decode_words, load_words, machine_words, probe_ran, server_loads, server_probe_words
from sizing.plan import Plan, comparison_lines, g3_decode_batch, g3_decode_context, g3_load_prompts, g3_output_tokens
from workloads.storage.fio import FioError, fio_version
from workloads.storage.inventory import collect_inventory
from workloads.traffic.processes import die_with_parent

from .config import GatesConfig
from .console import GateConsole, target_text
from .load_probe import load_levels, load_probe
from .machine_probe import decode_probe, prefill_endpoint, probe_servers, run_machine_probe
from .preflight import ability_line, failure_message, probe_engines, run_preflight
from .targets import EmbeddedServers, Endpoint, ServerStartError, endpoints_to_json, external_endpoints

SUITES = {"g1": "g1_arrival", "g2": "g2_baseline", "g3": "g3_main", "g4": "g4_soak"}
GATES_DIR = Path(__file__).parent
NEEDS_TARGETS = {"g2", "g3", "g4"}
NOT_APPLICABLE = "not run: not applicable"   # an unjudged check's reason when the candidate lacks what it tests
STATUS_STYLE = {"passed": "bold green", "failed": "bold red", "inconclusive": "bold yellow", "error": "bold red",
                "not run": "dim"}


def available_gates() -> list[str]:
    """Gates whose suite exists in this installation, in order."""
    return [g for g, suite in SUITES.items() if (GATES_DIR / suite).is_dir()]


RESUMABLE = ("g4",)   # gates that keep their progress in the run directory (the soak's windows)


def new_run_dir(out: Optional[Path]) -> tuple[str, Path]:
    """A new run id and its directory; `--out` must be a new or empty directory (ConfigError otherwise)."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    out = Path(out) if out is not None else Path("reports") / "runs" / run_id
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"--out: expected a new or empty directory for the run, found a dangling link {str(out)!r}")
    if out.is_dir() and any(p.name != RUN_LOCK for p in out.iterdir()):   # a lock a dead run left: empty
        hint = " (a run: --resume continues its G4 soak)" if (out / "run.json").exists() else ""
        raise ConfigError(f"--out: expected a new or empty directory for the run, found {str(out)!r} holding "
                          f"files{hint}")
    check_creatable_dir(out, "--out", "a new or empty directory for the run")
    return run_id, out


def check_resume(run_dir: Path, gates: list[str]) -> None:
    """`--resume` continues only gates that keep their progress, and only in a run that had them."""
    cannot = [g for g in gates if g not in RESUMABLE]
    if cannot:
        raise ConfigError(f"--resume: expected only gates that can resume ({', '.join(RESUMABLE)}: the soak keeps "
                          f"its windows), found {', '.join(cannot)}: start a new run for "
                          f"{'it' if len(cannot) == 1 else 'them'}")
    had = [str(g) for g in RunStore(run_dir).run_info().get("gates", [])]
    missing = [g for g in gates if g not in had]
    if missing:
        raise ConfigError(f"--resume: expected a run that had {', '.join(missing)}, found a run of "
                          f"{', '.join(had) or 'no gates'} in {str(run_dir)!r}")


def check_storage_path(path: Path) -> None:
    """storage.path is a writable directory, or can be made one (nothing is created here); ConfigError otherwise."""
    check_creatable_dir(path, "storage.path", "a directory (or a path to create one)")


def check_creatable_dir(path: Path, field: str, expected: str) -> None:
    """`path` is a writable directory or can be created as one; checked without creating anything."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{field}: expected {expected}, found an existing file {str(path)!r}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{field}: expected {expected}, found the file {str(existing)!r} on its way")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(f"{field}: expected a writable directory, found {str(path)!r}: Read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK) or _pseudo_filesystem(existing):
        raise ConfigError(f"{field}: expected a writable directory, found {str(path)!r}: {str(existing)!r} does not "
                          "take new files")


def _pseudo_filesystem(path: Path) -> bool:
    """/proc and /sys take no new files even for root (whose access() says yes)."""
    return any(Path(path).resolve().is_relative_to(root) for root in ("/proc", "/sys"))


def environment_fingerprint(config: GatesConfig) -> dict:
    versions = {"python": platform.python_version()}
    for package in ("kvgate", "torch", "locust", "fastapi", "pydantic"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    try:
        versions["fio"] = fio_version()
    except FioError:
        versions["fio"] = "not installed"
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=GATES_DIR)
    inventory = collect_inventory()
    return {
        "versions": versions, "config_digest": config.digest(),
        "git_sha": git.stdout.strip() if git.returncode == 0 else "unknown",
        "host": inventory.get("host"), "cpu": inventory.get("cpu"), "memory": inventory.get("memory"),
        "gpus": inventory.get("gpus"),
    }


def gate_status(verdicts: list[dict], pytest_exit_code: int, unjudged: Sequence[dict] = (),
                errors: Sequence[dict] = ()) -> tuple[str, str]:
    """A gate's outcome from its verdicts; a crash or a missing verdict is an error, never a pass.

    A check that erred outside its verdict (`errors`, RunStore.errors rows) makes the gate "error" with the
    first one's reason, unless a verdict failed. Figures measured without a rule (`unjudged`, their rows) never
    count as passed checks; the summary says how many. A gate none of whose checks applies to the candidate
    (each not run as not applicable: a vLLM with no tier below the device in G2) is "not run", saying why: it
    neither passes nor errs.
    """
    failed = [v for v in verdicts if v["status"] == "FAIL"]
    unsure = [v for v in verdicts if v["status"] == "INCONCLUSIVE"]
    if failed:
        return "failed", failed[0]["reason"]
    if errors:
        more = f" ({len(errors)} checks errored)" if len(errors) > 1 else ""
        return "error", f"{errors[0]['check']}: {errors[0]['reason']}{more}"
    if unsure:
        return "inconclusive", unsure[0]["reason"]
    if pytest_exit_code not in (0, 1, 5) or (pytest_exit_code == 1 and not failed and not unsure):
        return "error", f"a check crashed outside its verdict (pytest exit {pytest_exit_code}): see pytest.log"
    if not verdicts:
        reasons = [row.get("reason", "") for row in unjudged if row.get("reason", "").startswith(NOT_APPLICABLE)]
        if reasons:     # the rest measured without a rule: nothing decides the gate
            return "not run", f"no check applies to the candidate: {reasons[0].removeprefix('not run: ')}"
        return "error", "no check was judged"
    not_judged = f"; {len(unjudged)} measured, not judged" if unjudged else ""
    return "passed", f"{len(verdicts)} checks passed{not_judged}"


def plain_progress_lines(title: str, steps: list[dict], terminal: bool) -> list[str]:
    """The plain lines a console prints for a gate's new step lines (RunStore.progress_steps).

    On a terminal none: the spinner shows the gate's latest line, a step's or a running step's live
    figures. Elsewhere (CI logs) one line per step line, each once, and never a live one, which
    changes every few seconds and is not among the step lines.
    """
    return [] if terminal else [f"  {title}: {row['text']}" for row in steps]


def preflighted(endpoints: dict[str, Endpoint], config: GatesConfig) -> dict[str, Endpoint]:
    """The endpoints a run uses, the ones pre-flight checks: an A/A run against external targets leaves the
    baseline out (the candidate serves its role; an unused endpoint that is down must not stop the run)."""
    if config.aa and config.targets.kind == "external":
        return {role: endpoint for role, endpoint in endpoints.items() if role != "baseline"}
    return endpoints


class GateRunner:
    def __init__(self, config: GatesConfig, run_dir: Path, run_id: str, gates: list[str],
                 continue_on_fail: bool, console: Optional[Console] = None, resume: bool = False) -> None:
        self.config, self.run_dir, self.run_id, self.gates = config, run_dir, run_id, gates
        self.continue_on_fail, self.resume = continue_on_fail, resume
        self.store = RunStore(run_dir)
        self.console = console or GateConsole()
        self.suite_env: dict[str, str] = {}  # for the gate suites: the embedded servers' admin token
        self.last_plan: Optional[Plan] = None    # the sizing model's latest plan (sizing/in_run.py)
        self.endpoints: dict[str, Endpoint] = {}

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.resume:  # the same run, its config and raw data kept; the resumed gates start again
            info = self.store.run_info()
            info.setdefault("resumed_at", []).append(time.time())
            info["gates"] = sorted(set(info.get("gates", [])) | set(self.gates))
        else:
            (self.run_dir / "config.yaml").write_text(
                yaml.safe_dump(self.config.model_dump(mode="json"), sort_keys=False))
            info = {"run_id": self.run_id, "started_at": time.time(), "profile": self.config.profile,
                    "gates": self.gates, "environment": environment_fingerprint(self.config)}
        self.store.write_run_info(info)
        self.console.print(f"[bold]kvgate run[/bold] {self.run_id}  profile {self.config.profile}  "
                           f"gates {' '.join(self.gates)}  → {self.run_dir}")
        if self.config.aa:
            self.console.print("  A/A: G3's baseline role is the candidate itself, G2's pairs put the storage's best "
                               "job on both sides; each interval that excludes the null is a false decision of the "
                               "harness")
        try:
            servers, endpoints = self._targets(info)
        except ServerStartError as error:  # said at once, as a pre-flight failure is
            servers, endpoints, problem = None, {}, str(error)
        else:
            problem = ""
        self.endpoints = endpoints
        with servers or nullcontext():
            problem = problem or (self._preflight(endpoints) if endpoints else "")
            statuses = [] if problem else self._run_gates()
        info["ended_at"] = time.time()
        self.store.write_run_info(info)
        if not problem:
            self._sizing()
        if problem:
            for gate in self.gates:
                self.store.set_status(gate, "not run", problem)
        self._render()
        if problem:
            print(f"kvgate run: {printable(problem)}", file=sys.stderr)
            return 2
        outcome, _ = overall_status([{"gate": gate, "status": status, "requested": True}
                                     for gate, status in zip(self.gates, statuses)])
        return self._aa_exit_code(statuses) if self.config.aa else exit_code(outcome)

    def _aa_exit_code(self, statuses: list[str]) -> int:
        """An A/A run judges the harness, not the subject (whose verdicts FAIL by design): 0 when its intervals were
        measured and none excluded the null and no gate errored, else 1."""
        excluded, measured = 0, 0
        for gate in self.gates:
            gate_excluded, gate_measured, _ = false_decisions(self.store.measurements(gate))
            excluded, measured = excluded + gate_excluded, measured + gate_measured
        return 0 if measured and not excluded and "error" not in statuses else 1

    def _sizing(self) -> None:
        """Predicted beside measured for every gate that ran (sizing.json), shown on the console."""
        try:
            sizing = final_sizing(self.store, self.last_plan, self.config)
        except Exception as error:  # informational: never the run's outcome
            self.console.print(f"[dim]sizing model: no comparison ({type(error).__name__}: {error})[/dim]")
            return
        self.store.write_sizing(sizing)

        if sizing["comparison"]:
            self.console.print(f"[dim]sizing model: {'predicted':>57} {'measured':>9}  error[/dim]", highlight=False)
        for line in comparison_lines(sizing["comparison"]):
            self.console.print(f"  [dim]{line}[/dim]", highlight=False)
        for row in sizing["accuracy"]:
            self.console.print(f"[dim]sizing model: {row['label']} {row['text']}[/dim]", highlight=False)

    def _preflight(self, endpoints: dict[str, Endpoint]) -> str:
        """Check every target before any gate (gates/preflight.py); what failed, or '' when all passed."""
        endpoints = preflighted(endpoints, self.config)
        with self.console.status("pre-flight: every target's /models and one streamed token …"):
            results = run_preflight(endpoints, contexts=self.config.g2.contexts if "g2" in self.gates else None)
        rows = [r.to_dict() for r in results]
        for r in results:
            mark = "[green]ok[/green]" if r.ok else "[red]FAILED[/red]"
            self.console.print(f"  pre-flight {mark} {target_text(r.line())}", highlight=False)
        failed = failure_message(results)
        if not failed:      # what each engine really allows, before any gate relies on it
            with self.console.status("pre-flight: probing each engine's cache controls …"):
                probed = probe_engines(self.config, endpoints)
            for row in rows:
                if row["role"] in probed:
                    row.update(probed[row["role"]])
                    self.console.print(f"  [dim]{target_text(ability_line(row['role'], row['abilities']))}[/dim]",
                                       highlight=False)
            self._probe_machine()
        self.store.write_preflight(rows)
        return failed

    def _probe_machine(self) -> None:
        """This machine's speed at the embedded model's shapes, for the sizing model (sizing/machine.py)."""
        if self.config.targets.kind != "embedded" or not set(PREDICTED_GATES) & set(self.gates):
            return
        with self.console.status("pre-flight: probing this machine for the sizing model …"):
            probe = run_machine_probe(self.config.targets.embedded)
        self.store.write_machine_probe(probe)
        self.console.print(f"  [dim]{machine_words(probe)}[/dim]", highlight=False)

    def _probe_servers(self, gate: str) -> None:
        """Just before the first gate the sizing model predicts (G2, else G3): the first tokens of the server G2 takes
        recompute's from (an external target's too) and the embedded tiered server's hits (sizing/machine.py's
        curve and hit costs), timed at that gate's minute (both recorded in three runs, G2 TTFT MAPE 26.2 / 8.2 /
        46.3% from the pre-flight's, 16.1 / 12.9 / 12.9% from these: docs/results.md)."""
        probe = self.store.machine_probe()        # {} for external targets: no machine probe, the servers' alone
        if "error" in probe or "prefill" in probe or prefill_endpoint(self.endpoints) is None:
            return
        with self.console.status(f"before {gate.upper()}: timing the servers' first tokens and hits for the sizing "
                                 "model …"):
            probe = probe_servers(probe, self.endpoints, max(self.config.g2.contexts),
                                  self.store.run_info().get("run_id", "run"), self.suite_env.get(ADMIN_TOKEN_ENV))
        self.store.write_machine_probe(probe)
        self.console.print(f"  [dim]before {gate.upper()}: {server_probe_words(probe)}[/dim]", highlight=False)

    def _probe_decode(self) -> None:
        """Just before G3, beside the prefill probe: the same server's decode steps at the median prompt of G3's
        workload (sizing/machine.py's decode cost), timed at the gate's minute and context."""
        probe, endpoint = self.store.machine_probe(), prefill_endpoint(self.endpoints)
        if not probe_ran(probe) or endpoint is None:
            return
        try:
            context = g3_decode_context(self.config)
        except Exception as error:  # the sizing model never stops a run: G3 itself says what its workload lacks
            probe["server_decode"] = {"role": endpoint.role, "error": f"G3's workload: {type(error).__name__}: {error}"}
        else:
            with self.console.status(f"before G3: timing the {endpoint.role} server's decode at {context:,} tokens …"):
                probe["server_decode"] = decode_probe(endpoint, context, g3_decode_batch(self.config),
                                                      self.store.run_info().get("run_id", "run"))
            self._probe_load(probe, context)
        self.store.write_machine_probe(probe)
        self.console.print(f"  [dim]before G3: {decode_words(probe['server_decode'])}[/dim]", highlight=False)
        for load in server_loads(probe).values():
            self.console.print(f"  [dim]before G3: {load_words(load)}[/dim]", highlight=False)

    def _probe_load(self, probe: dict, context: int) -> None:
        """Each target server's steps while requests come and go as in G3 (gates/load_probe.py), at G3's context and
        output, for the costs per target the sizing model fits (sizing/machine.py's `load_costs`): the candidate's
        returning prompts, the baseline's new ones."""
        loads = probe["server_load"] = {}
        endpoints = {role: self.endpoints[role] for role in ("candidate", "baseline") if role in self.endpoints}
        try:
            output, prompts = g3_output_tokens(self.config), g3_load_prompts(self.config, context)
        except Exception as error:  # the sizing model never stops a run: G3 itself says what its workload lacks
            why = f"G3's workload: {type(error).__name__}: {error}"
            loads.update({role: {"role": endpoint.role, "error": why} for role, endpoint in endpoints.items()})
            return
        for role, endpoint in endpoints.items():
            returns = role == "candidate"
            what = f"{prompts} prompts" if returns else "new prompts"
            with self.console.status(f"before G3: timing the {role} server under load ({what}) …"):
                loads[role] = load_probe(endpoint, context, output, load_levels(self.config.g3.levels), prompts,
                                         self.store.run_info().get("run_id", "run"), returns=returns)

    def _targets(self, info: dict) -> tuple[Optional[EmbeddedServers], dict[str, Endpoint]]:
        if not NEEDS_TARGETS & set(self.gates):
            return None, {}
        if self.config.targets.kind == "external":
            endpoints = external_endpoints(self.config)
            info["targets"] = endpoints_to_json(endpoints)
            self.store.write_run_info(info)
            return None, endpoints
        servers = EmbeddedServers(self.config, self.run_dir)
        with self.console.status("starting the embedded servers (recompute, device-only, tiered) …"):
            try:
                endpoints = servers.start()
            except BaseException:
                servers.stop()
                raise
        info["targets"] = endpoints_to_json(endpoints)
        self.store.write_run_info(info)
        self.suite_env = servers.client_environment()
        for role, endpoint in endpoints.items():
            nodes = f"  + {len(endpoint.nodes) - 1} more node(s), {endpoint.routing}" if len(endpoint.nodes) > 1 else ""
            self.console.print(f"  {role:<9} {endpoint.mode:<11} {endpoint.url}{nodes}")
        return servers, endpoints

    def _run_gates(self) -> list[str]:
        statuses, stopped_at = [], None
        for gate in self.gates:
            if stopped_at is not None:
                reason = f"not run: stopped at {stopped_at.upper()}"
                self.store.set_status(gate, "not run", reason)
                self.console.print(f"[dim]{GATE_TITLES[gate]}: {reason}[/dim]")
                statuses.append("not run")
                continue
            self._predict(gate)
            status = self._run_gate(gate)
            statuses.append(status)
            if status != "passed" and not self.continue_on_fail:
                stopped_at = gate
        return statuses

    def _predict(self, gate: str) -> None:
        """The sizing model's figures for `gate`, from the config and the gates measured so far (recorded)."""
        if gate not in PREDICTED_GATES:
            return                # nothing of it is predicted: no plan (a replay and a simulation) to make
        self._probe_servers(gate)      # the first of G2 and G3 (once a run: the probe is recorded)
        if gate == "g3":
            self._probe_decode()
        plan, problem = stage_plan(self.config, self.store, gate)
        self.last_plan = plan or self.last_plan
        for line in gate_lines(plan, gate) if plan is not None else [problem]:
            self.console.print(f"  [dim]{line}[/dim]", highlight=False)

    def suite_path(self, gate: str) -> Path:
        """The folder of the gate's pytest suite."""
        return GATES_DIR / SUITES[gate]

    def _run_gate(self, gate: str) -> str:
        gate_dir = self.store.gate_dir(gate)
        gate_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pytest", str(self.suite_path(gate)), "-p", "no:cacheprovider",
                   "--rootdir", str(GATES_DIR.parent), "--kvgate-run-dir", str(self.run_dir.resolve()),
                   "--kvgate-gate", gate, "--junitxml", str((gate_dir / "junit.xml").resolve()), "-q", "-rN"]
        started = time.time()
        shown = errored = 0
        running = f"{GATE_TITLES[gate]} running …"
        steps = self.store.progress_steps(gate)
        steps.read_new()   # the step lines of an earlier attempt (a resumed soak) were said then
        with open(gate_dir / "pytest.log", "a") as log, self.console.status(running) as spinner:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=GATES_DIR.parent,
                                       preexec_fn=die_with_parent, env=os.environ | self.suite_env)
            while process.poll() is None:
                shown = self._print_new_verdicts(gate, shown)
                errored = self._print_new_errors(gate, errored)
                progress = self.store.progress(gate)
                spinner.update(f"{running} {target_text(progress)}" if progress else running)
                self._print_plain(gate, steps.read_new())
                time.sleep(0.5)
        self._print_plain(gate, steps.read_new())
        self._print_new_verdicts(gate, shown)
        self._print_new_errors(gate, errored)
        status, reason = gate_status(self.store.verdicts(gate), process.returncode, self.store.unjudged(gate),
                                     self.store.errors(gate))
        self.store.set_status(gate, status, reason, started_at=started, ended_at=time.time(),
                              pytest_exit_code=process.returncode)
        style = STATUS_STYLE.get(status, "bold")
        self.console.print(f"[{style}]{GATE_TITLES[gate]}: {status.upper()}[/{style}]  "
                           f"({time.time() - started:.0f} s) {target_text(reason)}")
        aa_line = false_decision_line(self.store.measurements(gate))
        if aa_line:
            self.console.print(f"  {aa_line}", highlight=False)
        return status

    def _print_plain(self, gate: str, steps: list[dict]) -> None:
        for line in plain_progress_lines(GATE_TITLES[gate], steps, self.console.is_terminal):
            print(printable(line), flush=True)

    def _print_new_verdicts(self, gate: str, shown: int) -> int:
        """Each verdict the gate wrote since the last call, with the sizing model's prediction beside it."""
        verdicts = self.store.verdicts(gate)
        predictions = self.store.predictions() if verdicts[shown:] else []
        for v in verdicts[shown:]:
            color = {"PASS": "green", "FAIL": "red", "INCONCLUSIVE": "yellow"}.get(v["status"], "white")
            shown_beside = beside(v, predictions)
            extra = f"  [dim]({beside_text(shown_beside, str(v.get('unit') or ''))})[/dim]" if shown_beside else ""
            self.console.print(f"  [{color}]{v['status']:<12}[/{color}] {target_text(v['reason'])}{extra}",
                               highlight=False)
        return len(verdicts)

    def _print_new_errors(self, gate: str, shown: int) -> int:
        """Each check the gate stored as errored since the last call, with its reason (as verdicts are shown)."""
        errors = self.store.errors(gate)
        for e in errors[shown:]:
            self.console.print(f"  [red]{'ERROR':<12}[/red] {target_text(e['check'])}: {target_text(e['reason'])}",
                               highlight=False)
        return len(errors)

    def _render(self) -> None:
        # deferred: the renderer imports matplotlib (seconds), drawn once at the end
        from reports.render import render_run

        results = render_run(self.run_dir)
        overall = results["overall"]
        style = STATUS_STYLE.get(overall["status"], "bold")
        self.console.print(f"[{style}]overall: {overall['status'].upper()}[/{style}]  "
                           f"{target_text(overall['summary'])}")
        self.console.print(f"report: {(self.run_dir / 'index.html').resolve()}")
