"""MIG rebalancing: built-in profile tables, a minimal-change planner, and an NVML applier.

Import the submodules directly; this package imports nothing so that the read-only GPU
script can load `profiles` on a machine that has only the standard library and pynvml.
"""
