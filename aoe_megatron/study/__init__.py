"""The evidence study (``make study``, tools/study.py): arms x seeds trained through the real entry
point, evaluated on held-out text and compared with the MoE baseline seed by seed; and the norm
probes of the paper's claim that experts know what they know (tools/norm_probe.py)."""
