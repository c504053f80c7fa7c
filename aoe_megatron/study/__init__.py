"""The evidence study (``make study``, aoe-study): arms x seeds trained through the real entry
point, evaluated on held-out text and compared with the MoE baseline seed by seed; and the norm
probes of the paper's claim that experts know what they know (aoe-norm-probe)."""
