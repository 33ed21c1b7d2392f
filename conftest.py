"""Root pytest configuration: loads the gate plugin (options, run context, record and verdict fixtures).

The gate suites under gates/ are run by `kvgate run`; the project's own tests
are under tests/. At the root, this file also makes `cache_impl`, `gates` and
`workloads` importable for both.
"""

pytest_plugins = ["gates.plugin"]
