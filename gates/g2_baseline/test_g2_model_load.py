"""G2 model service loading on the storage under test (g2.model_load; gates/g2_baseline/model_load.py).

A safetensors checkpoint (an existing model, read only, or a random one written here) is loaded cold
by each loader in alternating rounds beside the storage's best read job (G1's sweep) reading the same
files, until the judged loader's anytime-valid interval decides (g2.model_load.judged: kvgate's own by
default, so the storage is judged; the field's loaders beside it as diagnostics); every load is checked
tensor by tensor, and with a baseline path the judged loader's speedup over it is judged too. Then a server is started
per loader and timed to its first token: the embedded
`kvgate serve --weights`, or the external engine's own `launch` command.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys

import pytest

from cache_impl.weights.loaders import loader_unavailable
from cache_impl.weights.safetensors_dir import CheckpointFormatError, read_safetensors_dir
from gates.g2_baseline.model_load import (
    measure_aa_reads,
    measure_loaders,
    measure_speedup,
    median_phases,
    prepare_checkpoints,
)
from gates.side_by_side import Pairing
from gates.storage_best import storage_best
from kvcore.aa import G2_AA_FALSE_DECISION, ratio_excludes_one
from kvcore.percent import format_percent
from workloads.probes.service_load import ServiceStartError, time_service_start
from workloads.traffic.processes import free_port

SERVICE_DIR = "model-load-service"
METRIC = "model_load_vs_storage_best"   # under storage.path: the embedded model's exported weights


def _settings(gate_context):
    settings = gate_context.config.g2.model_load
    if not settings.enabled:
        pytest.skip("g2.model_load.enabled is false")
    return settings


@pytest.fixture(scope="module")
def checkpoints(gate_context):
    settings = _settings(gate_context)
    store = gate_context.store
    try:
        prepared = prepare_checkpoints(settings, gate_context.config.storage.path,
                                       lambda text: store.set_progress("g2", text))
    except (CheckpointFormatError, OSError) as error:
        pytest.fail(f"G2 model load: {error}", pytrace=False)
    yield prepared
    prepared.close()


@pytest.fixture(scope="module")
def available_loaders(gate_context, checkpoints):
    """The configured loaders that import and run here; the others are said so in the run store."""
    settings = gate_context.config.g2.model_load
    missing = {loader: loader_unavailable(loader) for loader in settings.loaders if loader_unavailable(loader)}
    usable = [loader for loader in settings.loaders if loader not in missing]
    for loader, reason in missing.items():
        gate_context.store.record("g2", "model_load_loaders", "model_load_loader_unavailable", None, loader=loader,
                                  reason=reason)
    if settings.judged in missing:
        pytest.fail(f"G2 model load: the judged loader (g2.model_load.judged) does not run here: "
                    f"{missing[settings.judged]}", pytrace=False)
    return usable


@pytest.fixture(scope="module")
def loader_figures(gate_context, checkpoints, available_loaders):
    """Every loader's cold rounds, each beside the storage's best read job (G1's sweep) reading the same files."""
    settings, store = gate_context.config.g2.model_load, gate_context.store
    # each mode's fastest sweep job that streams the checkpoint's bytes
    best = storage_best(gate_context.config, store).for_bytes(checkpoints.under_test.tensor_bytes)
    rule = gate_context.config.rule("g2", METRIC)

    def on_round(round_) -> None:
        store.record("g2", "model_load_rounds", "model_load_round", round_.pair.subject.gbps, "GB/s",
                     **round_.context())

    figures, yardstick = measure_loaders(checkpoints.under_test, available_loaders, settings.judged,
                                         Pairing.of(settings.rounds),
                                         [rule] if rule else [], settings.reads, best,
                                         lambda text: store.set_progress("g2", text), on_round)
    for loader, f in figures.items():
        judged = f.judged
        warm = f.warm or {}
        store.record("g2", "model_load_rounds", "model_load_loader", judged.value, "%", loader=loader,
                     judged_loader=loader == settings.judged,
                     loader_gbps=judged.subject_gbps, **judged.record_context(), cold_rounds=f.cold,
                     identical_rounds=f.identical, phases=median_phases(f), warm_gbps=warm.get("gbps"),
                     warm_read_device=warm.get("cold"), **best.context("read"))
    return figures, best, yardstick


def test_the_judged_loader_reads_the_checkpoint_near_the_storages_best(gate_context, checkpoints, loader_figures,
                                                                        record, verdict):
    figures, storage, yardstick = loader_figures
    judged_loader = figures[gate_context.config.g2.model_load.judged]
    judged = judged_loader.judged
    if judged.value is None:
        pytest.fail(f"G2 model load: {judged_loader.loader} gave no side-by-side ratio", pytrace=False)
    cold = ("" if judged_loader.cold == len(judged_loader.rounds) else
            f"; only {judged_loader.cold} of {len(judged_loader.rounds)} rounds read the device (the rest came from "
            f"a cache)")
    options = judged.verdict_options()
    if judged_loader.cold < len(judged_loader.rounds):
        options.update(valid=False, invalid_reason=f"{len(judged_loader.rounds) - judged_loader.cold} rounds were "
                                                   f"not cold")
    record(METRIC, judged.value, "%", loader=judged_loader.loader, **judged.record_context(),
           loader_gbps=judged.subject_gbps, field_loaders=field_loader_shares(figures, judged_loader.loader),
           **storage.context("read"))
    size = checkpoints.under_test.tensor_bytes / 1e9
    wins = yardstick.describe_wins([r.pair for r in judged_loader.rounds])
    beside = describe_field_loaders(figures, judged_loader.loader)
    verdict(f"G2 model load: {judged_loader.loader} / the storage's best read ({storage.describe()}) of the same "
            f"{size:.2f} GB cold, side by side ({judged.describe()}{'; ' + wins if wins else ''}{cold})"
            f"{'; ' + beside if beside else ''}", METRIC, judged.value, context={"loader": judged_loader.loader},
            **options)


def field_loader_shares(figures: dict, judged: str) -> dict[str, float]:
    """Each loader not judged: its side-by-side share of the storage's best read."""
    return {f.loader: f.judged.value for f in figures.values() if f.loader != judged and f.judged.value is not None}


def describe_field_loaders(figures: dict, judged: str) -> str:
    """'beside it, safetensors reaches 72% of what this storage delivers, runai_streamer 68%'."""
    shares = [f"{loader} {format_percent(value, 0)}" for loader, value in field_loader_shares(figures, judged).items()]
    if not shares:
        return ""
    first, *rest = shares
    name, share = first.rsplit(" ", 1)
    return (f"beside it, {name} reaches {share} of what this storage delivers"
            f"{', ' + ', '.join(rest) if rest else ''}")


def test_aa_the_best_read_job_against_itself_on_the_same_files(gate_context, checkpoints, record):
    """A/A (aa: true): the storage's best read job on both sides of every pair, on the checkpoint's files, sampled
    as the loaders are; an interval that excludes 1 is a false decision of the harness (kvcore.aa)."""
    config, store = gate_context.config, gate_context.store
    if not config.aa:
        pytest.skip("not an A/A run (aa: false)")
    best = storage_best(config, store).for_bytes(checkpoints.under_test.tensor_bytes)
    rule = config.rule("g2", METRIC)
    judged = measure_aa_reads(checkpoints.under_test, Pairing.of(config.g2.model_load.rounds), [rule] if rule else [],
                              best, lambda text: store.set_progress("g2", text))
    record(G2_AA_FALSE_DECISION, ratio_excludes_one(judged.interval), of=METRIC, **judged.aa_context(),
           **best.context("read"))
    assert judged.pairs >= 1


def test_every_load_gave_the_tensors_that_were_written(loader_figures, record, verdict):
    rounds = [r for f in loader_figures[0].values() for r in f.every_load]
    identical = sum(r.identical for r in rounds)
    first_bad = next((r.mismatch for r in rounds if not r.identical), "")
    record("model_load_identical", identical / len(rounds), "%", loads=len(rounds))
    verdict(f"G2 model load: loads whose every tensor matched its checksum ({identical} of {len(rounds)}"
            f"{'; first mismatch: ' + first_bad if first_bad else ''})", "model_load_identical",
            identical / len(rounds), unit="%")


def test_speedup_over_the_baseline_storage(gate_context, checkpoints, loader_figures, record, verdict, not_run):
    settings = gate_context.config.g2.model_load
    label = "G2 model load: speedup over the baseline storage, same loader"
    if checkpoints.baseline is None:
        not_run(label, "model_load_speedup_vs_baseline", "needs a baseline storage path (g2.model_load.baseline_path)")
    judged = loader_figures[0][settings.judged]
    store = gate_context.store

    def on_round(storage: str, index: int, summary: dict) -> None:
        store.record("g2", "model_load_speedup", "model_load_round", summary["nbytes"] / summary["seconds"] / 1e9,
                     "GB/s", loader=judged.loader, round=index, storage=storage, seconds=summary["seconds"],
                     bytes=summary["nbytes"], cold=summary["cold"], phases=summary["phases"])

    speedup = measure_speedup(checkpoints, judged.loader, settings.rounds.min, settings.reads,
                              lambda text: store.set_progress("g2", text), on_round)
    record("model_load_speedup_vs_baseline", speedup.value, "×", loader=judged.loader, interval=list(speedup.interval),
           under_test_s=statistics.median(speedup.under_test_s), baseline_s=statistics.median(speedup.baseline_s))
    verdict(f"{label} ({judged.loader}: {statistics.median(speedup.baseline_s):.2f} s on {settings.baseline_path} "
            f"/ {statistics.median(speedup.under_test_s):.2f} s, {len(speedup.under_test_s)} pairs)",
            "model_load_speedup_vs_baseline", speedup.value, unit="×", interval=speedup.interval,
            context={"loader": judged.loader})


def _service_commands(gate_context, endpoints, available_loaders):
    """(loader, command, health URL, base URL, model, files to drop, api key) per timed start."""
    settings, config = gate_context.config.g2.model_load, gate_context.config
    if settings.launch is not None:
        candidate = endpoints.get("candidate")
        if candidate is None:
            pytest.skip("G2 service load: g2.model_load.launch needs the candidate endpoint for its first token")
        files = read_safetensors_dir(settings.path).files if settings.path is not None else ()
        key = os.environ.get(candidate.api_key_env) if candidate.api_key_env else None
        return [("launch", settings.launch, settings.health_url, candidate.url, candidate.model, files, key)]
    if config.targets.kind != "embedded":
        pytest.skip("G2 service load: an external engine needs g2.model_load.launch and health_url")
    # deferred: torch (seconds), only when the gate exports the model's weights
    from cache_impl.engine.weights import export_weights

    embedded = config.targets.embedded
    directory = config.storage.path / SERVICE_DIR
    exported = export_weights(directory, embedded.preset, embedded.seed, shard_bytes=16 << 20, overwrite=True)
    commands = []
    for loader in available_loaders:
        port = free_port()
        command = [sys.executable, "-m", "gates.cli", "serve", "--weights", str(directory), "--load-format", loader,
                   "--mode", "recompute", "--host", "127.0.0.1", "--port", str(port)]
        commands.append((loader, command, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1",
                         f"kvgate-{embedded.preset}", exported.files, None))
    return commands


def test_service_start_to_first_token_per_loader(gate_context, endpoints, available_loaders, record, verdict):
    if not gate_context.config.g2.model_load.service:
        pytest.skip("g2.model_load.service is false")
    store = gate_context.store
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_API_KEY"}
    started, failures = 0, []
    commands = _service_commands(gate_context, endpoints, available_loaders)
    for loader, command, health, base_url, model, files, key in commands:
        store.set_progress("g2", f"service load: starting {command[0] if loader == 'launch' else 'kvgate serve'} "
                                 f"with {loader}, cold")
        try:
            start = time_service_start(command, health, base_url, model, log=store.raw_dir("g2") /
                                       f"service-load-{loader}.log", drop=files, env=env, api_key=key)
        except ServiceStartError as error:
            failures.append(f"{loader}: {error}")
            continue
        started += 1
        record("service_load", start.first_token_s, "s", loader=loader, round=0, phases=start.phases(),
               weights=start.weights)
    reason = f"; {failures[0]}" if failures else ""
    verdict(f"G2 service load: starts that loaded the weights and streamed a first token ({started} of "
            f"{len(commands)}{reason})", "service_load_started", started / len(commands), unit="%")
    if gate_context.config.targets.kind == "embedded":
        shutil.rmtree(gate_context.config.storage.path / SERVICE_DIR, ignore_errors=True)
