"""The Table 1 probe's nodes and weightings (``hf_probe``), as data without torch:
``aoe-norm-probe --help`` lists them at once."""

from __future__ import annotations

NODES = {"gate": "x W_g", "up": "x W_p", "act": "SiLU(x W_g)", "prod": "SiLU(x W_g) * x W_p",
         "out": "experts' final outputs"}
RANDOM = "random"
"""The review's missing baseline for Table 1: each token's K experts drawn uniformly at random
(scores U(0, 1) in place of norms, a fixed generator; ``norm`` weighting is then near-uniform)."""
CHOICES = {**NODES, RANDOM: "random experts (baseline)"}
WEIGHTINGS = ("norm", "router")
