"""What the gates measure with: workloads, the streaming client, load, fio, inventory, faults."""
