"""Package data, installed as ``aoe_megatron._run``: model presets (``presets/``), DeepSpeed ZeRO
configs (``deepspeed/``), the Slurm launch template (``slurm/``), example data configs and study
specs. Found through ``aoe_megatron.runtime.resources``, never through paths into a checkout."""
