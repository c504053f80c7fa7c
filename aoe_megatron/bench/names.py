"""The benchmark's named entries, as data: the layer level's arms (``ARM_FIELDS``) and the model
level's archs and models. No torch here: ``aoe-bench --help`` lists them without loading it
(``arms`` and ``model`` build and time them)."""

from __future__ import annotations

NAIVE_FIELDS = {"lean_cache": False, "expert_backend": "autograd"}
#: arm -> AoE settings (None: megatron-core's MoE; ``moe-grouped``: its grouped-GEMM experts,
#: ``mcore_grouped.py``)
ARM_FIELDS = {"moe": None, "moe-grouped": None, "aoe": {}, "aoe-full-cache": {"lean_cache": False},
              "aoe-padded": {"expert_backend": "padded"},
              "aoe-grouped_mm": {"expert_backend": "grouped_mm"},
              "aoe-d_wide64": {"d_wide_multiple": 64},
              "aoe-d_wide64-nearest": {"d_wide_multiple": 64, "d_wide_round": "nearest"},
              "aoe-naive": NAIVE_FIELDS}

#: name -> (ModelConfig arch, model overrides in load_preset's nested form)
ARCHS = {"moe": ("moe", {}), "aoe": ("aoe", {}),
         "aoe-loop": ("aoe", {"aoe": {"expert_backend": "loop"}}),
         "aoe-grouped_mm": ("aoe", {"aoe": {"expert_backend": "grouped_mm"}})}
DEFAULT_ARCHS = ("moe", "aoe")
# name -> (preset, overrides, micro batch). NOTE: the 732M preset shrunk to 2 layers and 1024
# tokens a step, so that a step takes seconds on a 2-core CPU (the 32k-vocabulary output layer is
# then a third of the FLOPs); 732m-4l, at the preset's own 2048 tokens and micro-batch 4, is for
# GPUs (a step takes minutes on 2 CPU cores).
MODELS = {
    "tiny": ("tiny", {}, 4),
    "732m-2l": ("732m", {"num_layers": 2, "seq_length": 1024}, 1),
    "732m-4l": ("732m", {"num_layers": 4}, 4),
}
QUICK_MODELS = {"tiny": ("tiny", {}, 2)}
#: entries the default run leaves out on CPU (run them by naming them: --models)
GPU_ONLY_MODELS = ("732m-4l",)
