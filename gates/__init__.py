"""The gate side of kvgate: configuration, verdicts, the CLI and the G1-G4 suites."""
