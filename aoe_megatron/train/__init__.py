"""Pretraining: DeepSpeed ZeRO engine with megatron-core expert parallelism, schedule, loop."""
