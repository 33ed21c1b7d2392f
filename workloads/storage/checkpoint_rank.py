"""One rank of a `CheckpointJob`: joins the gloo process group, builds its state once, answers commands.

How it works: docs/methods/storage-best.md (workloads/storage/checkpoint_rank.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, TextIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from kvcore.files import fsync_directory, process_read_bytes
from workloads.storage.checkpoint import KVGATE_WRITER, CheckpointSpec
from workloads.storage.checkpoint_kvgate import HugePageBuffers, KvgateReader, KvgateWriter
from workloads.storage.checkpoint_state import build_state, differences, empty_state
from workloads.storage.checkpoint_writer import ErrorKeepingWriter


def _describe(error: BaseException) -> str:
    """An OSError as the OS says it ('[Errno 28] No space left on device: ...'); else 'Type: message'."""
    return str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"


def _failures(error: BaseException, rank: int) -> dict[str, str]:
    """{rank: message} of every rank's failure (a CheckpointException carries all of them)."""
    if isinstance(error, CheckpointException):
        return {str(r): _describe(exc) for r, (exc, _trace) in error.failures.items()}
    return {str(rank): _describe(error)}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(work: Callable[[], None], rank: int, device: torch.device) -> tuple[float, dict[str, str]]:
    """Run `work` between barriers; its seconds (this rank's) and the failures it raised."""
    dist.barrier()
    start = time.perf_counter()
    failures: dict[str, str] = {}
    try:
        work()
        _synchronize(device)
    except (Exception, CheckpointException) as error:
        failures = _failures(error, rank)
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds, failures


def save(state: dict, directory: str, thread_count: int, rank: int, device: torch.device,
         kind: str = KVGATE_WRITER, buffers: HugePageBuffers | None = None) -> dict:
    """`buffers`: kvgate's writer's buffers, kept over the rank's saves and restores (warm memory)."""
    writer: KvgateWriter | ErrorKeepingWriter
    if kind == KVGATE_WRITER:
        writer = KvgateWriter(directory, sync_files=True, thread_count=thread_count, buffers=buffers)
    else:
        writer = ErrorKeepingWriter(directory, sync_files=True, thread_count=thread_count)

    def work() -> None:
        dcp.save(state, storage_writer=writer)
        fsync_directory(Path(directory))

    seconds, failures = _timed(work, rank, device)
    first_error = getattr(writer, "first_error", None)
    if failures and first_error is not None:            # the OS's reason, not the zip writer's echo of it
        failures[str(rank)] = str(first_error)
    return {"ok": not failures, "seconds": seconds, "failures": failures,
            "direct": getattr(writer, "direct", False)}


def restore(spec: CheckpointSpec, state: dict, directory: str, rank: int, device: torch.device,
            kind: str = KVGATE_WRITER, buffers: HugePageBuffers | None = None) -> dict:
    fresh = empty_state(spec, rank, device)
    before = process_read_bytes()
    reader = KvgateReader(directory, buffers=buffers) if kind == KVGATE_WRITER else dcp.FileSystemReader(directory)
    seconds, failures = _timed(lambda: dcp.load(fresh, storage_reader=reader), rank, device)
    read_bytes = process_read_bytes() - before
    found = [] if failures else differences(spec, rank, state, fresh)
    return {"ok": not failures, "seconds": seconds, "read_bytes": read_bytes, "differences": found,
            "failures": failures}


def serve(spec: CheckpointSpec, rank: int, device: torch.device, commands: TextIO, answers: TextIO) -> None:
    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    state = build_state(spec, rank, device)
    buffers = HugePageBuffers()
    answer({"ready": True, "rank": rank, "device": str(device), "state_bytes": spec.rank_bytes(rank)})
    for line in commands:
        command = json.loads(line)
        kind = command.get("cmd")
        if kind == "exit":
            return
        if kind == "save":
            answer(save(state, command["directory"], int(command.get("thread_count", 1)), rank, device,
                        command.get("writer", KVGATE_WRITER), buffers))
        elif kind == "restore":
            answer(restore(spec, state, command["directory"], rank, device, command.get("reader", KVGATE_WRITER),
                           buffers))
        else:
            answer({"ok": False, "failures": {str(rank): f"unknown command {kind!r}"}})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the CheckpointSpec as JSON")
    parser.add_argument("--collective-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())     # stray prints go to stderr, not the answer pipe
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = CheckpointSpec.from_json(args.spec)
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.collective_timeout_s))
    try:
        serve(spec, rank, device, sys.stdin, answers)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
