"""The sizing model (`kvgate plan`): each gate's figures predicted from the model's KV layout, the workload,
the tiers' capacities and bandwidths and the recompute curve, then held to the measurements.

Torch-free: it reads configs and run data only.
"""
