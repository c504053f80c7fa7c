"""The AoE MoE layer (Algorithm 2) as megatron-core components.

Pure math first: ``ops`` (the paper's formulas: Eq. 5's width, the softmax over selected norms,
Ent_load/Ent_conf) and ``selection`` (top-K by cache norm and its variants), then the layer's
settings (``config``: AoEConfig, AoE's own; AoELayerConfig, those and the model's shared ones
from its TransformerConfig), the router (``router``: every expert's low-rank cache, one matmul), the token dispatcher with expert-parallel all-to-all (``dispatcher``), the experts
(``experts``), the MoE layer that joins them (``layer``), the autograd functions of the fused
expert path (``autograd``), the expert GEMM backends (``grouped``) and the per-global-expert
seeding (``seeding``). Nothing here imports the models, training or data packages.
"""
