"""G2 single-node baseline: recompute vs cache hits per tier and context length."""
