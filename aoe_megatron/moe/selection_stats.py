"""A router's selection statistics as running sums, read (and reset) when a step is logged.

Each forward adds, on the router's device and without a host sync: each expert's
selections, each expert's summed score (AoE: the cache norm; the stock router: its logit), the
summed per-token confidence entropy (Eq. 8) and the token count, and (in training) the micro-batch's
L_aux. ``figures()`` turns the sums into the logged figures over every token since the last
``reset()``: the load fractions f_i (Eqs. 6-7, normalised), each expert's mean score, the mean
Ent_conf and the mean L_aux over micro-batches. With one forward between two reads they are the
figures of that forward (``ops.load_fractions``, ``ops.confidence_entropy``: the float64
references, equal to fp32 rounding).

Each forward's reductions run in fp32 or wider (the counts in integers); the running sums are a handful
of float64 numbers, so a long interval's counts stay exact (fp32 counts stop being exact past 2^24,
a few steps of a large batch). They are not module buffers (a model cast to bf16 would cast them)
and live on the device of the first forward that adds to them.
"""

from __future__ import annotations

from typing import Optional

import torch


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (detached) in fp32, or in its own dtype where that is wider (float64 in tests)."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


class SelectionStats:
    """Running sums for one router with ``num_experts`` experts."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        # [selections E | score sums E | entropy sum | tokens | L_aux sum | micro-batches]
        self._sums: Optional[torch.Tensor] = None

    def _at(self, device: torch.device) -> torch.Tensor:
        if self._sums is None or self._sums.device != device:
            self._sums = torch.zeros(2 * self.num_experts + 4, dtype=torch.float64, device=device)
        return self._sums

    @torch.no_grad()
    def add(self, routing_map_TE: torch.Tensor, probs_TE: torch.Tensor,
            scores_TE: torch.Tensor) -> None:
        """One forward's tokens: the selections made, the distribution over all experts whose
        entropy is Ent_conf (AoE: softmax of the norms; the stock router: of its logits), and the
        scores that ranked the experts."""
        e = self.num_experts
        sums = self._at(scores_TE.device)
        sums[:e] += routing_map_TE.sum(0)
        sums[e:2 * e] += _at_least_fp32(scores_TE).sum(0)
        p = _at_least_fp32(probs_TE)
        sums[2 * e] -= torch.special.xlogy(p, p).sum()  # 0 log 0 = 0
        sums[2 * e + 1] += routing_map_TE.shape[0]

    @torch.no_grad()
    def add_aux(self, aux: torch.Tensor) -> None:
        """One training micro-batch's L_aux (Eq. 2 / Eq. 6)."""
        e = self.num_experts
        sums = self._at(aux.device)
        sums[2 * e + 2] += aux.detach()
        sums[2 * e + 3] += 1

    def figures(self) -> torch.Tensor:
        """[load E | mean score E | Ent_conf | L_aux] over everything added since the last reset
        (zeros where nothing was), on the sums' device (no host sync)."""
        e = self.num_experts
        sums = self._sums if self._sums is not None else torch.zeros(2 * e + 4, dtype=torch.float64)
        load = sums[:e] / sums[:e].sum().clamp_min(1)
        tokens = sums[2 * e + 1].clamp_min(1)
        return torch.cat([load, sums[e:2 * e] / tokens, (sums[2 * e] / tokens).view(1),
                          (sums[2 * e + 2] / sums[2 * e + 3].clamp_min(1)).view(1)])

    def reset(self) -> None:
        if self._sums is not None:
            self._sums.zero_()
