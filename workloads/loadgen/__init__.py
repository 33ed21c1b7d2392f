"""Load generation: locust run headless, its users, live figures, sweeps in side-by-side blocks, the warm-up's steady
rule, the capacity search's probes."""
