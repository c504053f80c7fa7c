"""Runtime plumbing shared by training, benchmarks and tools: process groups and collectives on
the right device (``distributed``), and run-time detection of optional GPU components
(``compat``: TransformerEngine, NVIDIA apex, fused kernels)."""
