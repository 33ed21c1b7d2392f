"""Root pytest configuration.

Putting this file at the repository root makes the root importable for the
project's tests (`cache_impl`, `gates`, `workloads`). The gate pytest plugin
(`gates.plugin`) is registered here once the gate suites exist.
"""
