"""kvgate's own engine predicted before any G2 has measured it: the pre-flight's machine probe
(cache_impl/machine_probe.py: this machine's matmul and attention FLOP/s at the embedded model's shapes,
its decode step, its host copy GB/s; recorded in the run as machine_probe.json) turned into the sizing
model's constants, standing in where a calibration's would go::

    recompute(n) = a + b·n + c·n²                                   (timing.RecomputeCurve.roofline)
    b = 2·matmul_params / matmul FLOP/s + 2·layers·dim·chunk / attention FLOP/s
    c = 2·layers·dim / attention FLOP/s
    a = the fixed overhead: the least first-token time of the pre-flight's two-token request sent once more
        to every embedded server, now warm (HTTP, the tokenizer, a prompt of a few tokens, the first token's
        sampling; a server's first answer carries its warm-up: 30 ms where a warm one takes a few)
    decode(b) = the probe's step_s + per_sequence_s·b;   the host tier's GB/s = the probe's host copy

Last in line (plan.make_plan): a run's own G2 and G3, a calibration file and a configured roofline come
first. Only the embedded targets are probed: an external engine's model is not kvgate's to count.
Torch-free: the gates run the probe (gates/machine_probe.py) in its own process, on the machine and device the
embedded engine uses; this module only reads its figures.
"""

from __future__ import annotations

from typing import Optional

from kvcore.rundata import RunStore

from .calibration import Calibration
from .queueing import DecodeCost
from .timing import RecomputeCurve

SOURCE = "the pre-flight's machine probe"


def probe_line(probe: dict) -> str:
    """The probe's figures in one console line (or why there are none)."""
    if "error" in probe:
        return f"machine probe: none ({probe['error']}): the sizing model waits for G2's measurements"
    decode = probe["decode"]
    return (f"machine probe ({probe['device']}, {probe['dtype']}, the {probe['preset']} preset's shapes, "
            f"{probe['threads']} threads): matmul {probe['matmul_flops'] / 1e9:.1f} GFLOP/s, attention "
            f"{probe['attention_flops'] / 1e9:.1f} GFLOP/s, decode {decode['step_s'] * 1e3:.2f} ms + "
            f"{decode['per_sequence_s'] * 1e3:.2f} ms per sequence, host copy {probe['host_copy_gbps']:.2f} GB/s "
            f"({probe['seconds']:.1f} s){_overhead_words(probe.get('fixed_overhead_s'))}")


def _overhead_words(seconds: Optional[float]) -> str:
    return "; no warm first token, so no fixed overhead" if seconds is None else (
        f"; a warm two-token request's first token {seconds * 1e3:.1f} ms")


def probe_calibration(probe: dict) -> Optional[Calibration]:
    """The module's constants from a probe's figures (gates/machine_probe.py's `probe_machine`); None when the probe failed."""
    if not probe or "error" in probe:
        return None
    overhead = probe.get("fixed_overhead_s")
    curve = RecomputeCurve.roofline(probe["matmul_params"], probe["layers"], probe["attention_dim"],
                                    probe["matmul_flops"], overhead or 0.0, attention_flops=probe["attention_flops"],
                                    chunk_tokens=probe["chunk_tokens"])
    curve = RecomputeCurve(curve.a, curve.b, curve.c, f"{SOURCE}: {curve.source}")
    decode = DecodeCost(probe["decode"]["step_s"], probe["decode"]["per_sequence_s"])
    return Calibration(curve=curve, fixed_overhead_s=overhead, decode=decode, host_gbps=probe["host_copy_gbps"],
                       source=SOURCE, notes=(probe_line(probe),))


def run_probe_calibration(store: RunStore) -> Optional[Calibration]:
    """`probe_calibration` of what a run recorded (None when it has no probe, as a run of an external engine)."""
    return probe_calibration(store.machine_probe())
