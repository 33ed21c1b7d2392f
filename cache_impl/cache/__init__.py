"""The tiered KV cache: keys, the index and placement, the tiers (device, host, disk, remote), write-behind, integrity
and scrub, fault injection."""
