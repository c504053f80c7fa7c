"""Benchmarks of the AoE MoE layer against megatron-core's stock MoE layer (``make bench``).

``flops`` holds the analytic FLOP counts (pure functions), ``measure`` the timing and memory
probes, ``layer`` / ``model`` / ``ep`` the three benchmark levels and ``report`` the writers.
The command line is ``aoe-bench``.
"""
