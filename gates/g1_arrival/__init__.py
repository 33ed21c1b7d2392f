"""G1 arrival acceptance: inventory and fio storage baselines against the spec sheet."""
