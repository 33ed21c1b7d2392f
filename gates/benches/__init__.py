"""The benches that are not gates: `kvgate cache-bench`, `engine-bench`, `pool-bench` and `client-bench`, each printing
figures (the cache against the storage's best, the engine, the shared pool, the load client's fidelity)."""
