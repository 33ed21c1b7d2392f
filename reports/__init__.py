"""Report rendering (HTML, JUnit, JSON) for gate runs; `reports/runs/` holds run output and is git-ignored."""
