"""Tiers behind one small interface (see base.py): device pool, host DRAM, disk directory."""
