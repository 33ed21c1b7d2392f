"""The storage tools: fio and its sweep of the storage's best, the machine's inventory, checkpoints from N ranks (DCP
and kvgate's own writer)."""
