"""A target probed beside its load: fault injection and its admin client, per-tier hits from /metrics, model service
loading timed from outside."""
