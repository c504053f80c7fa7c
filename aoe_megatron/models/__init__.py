"""GPT models with AoE or stock MoE layers: the preset schema and model builder (``gpt``), the
megatron-core layer specs (``spec``), the baseline's router variants (``moe_router``) and the
parameter count (``params``, ``make params``). Built on ``aoe_megatron.moe``."""
