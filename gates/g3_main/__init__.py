"""G3 main gate: concurrency sweeps of TTFT and throughput, tiered candidate vs baseline."""
