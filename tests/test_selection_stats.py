"""The routers' selection statistics off the hot path (issue #37 item 3): running sums over the
forwards since the last read (``moe/selection_stats.py``), equal to the float64 definitions the
logged figures always had (``ops.load_fractions``, ``ops.confidence_entropy``, the mean score)
over the pooled tokens, so one forward between two reads gives what a finished study recorded;
and the MoE baseline's figures from the logits its router computes anyway: one gating matmul per
forward, not two."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aoe_megatron.moe import ops
from aoe_megatron.moe.selection_stats import SelectionStats
from tests.helpers import make_transformer_config

E, K = 6, 2


def _forward(tokens: int, seed: int, dtype=torch.float32):
    """(routing map, softmax over all experts, scores) of one forward's tokens: top-K by score."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(tokens, E, generator=g, dtype=torch.float64) * 2).to(dtype)
    routing = torch.zeros(tokens, E, dtype=torch.bool).scatter(-1, scores.topk(K, -1).indices, True)
    return routing, torch.softmax(scores, -1), scores


def _definitions(forwards) -> torch.Tensor:
    """The figures as defined, in float64 over every token: [load | mean score | Ent_conf]."""
    routing, probs, scores = (torch.cat([f[i] for f in forwards]) for i in range(3))
    return torch.cat([ops.load_fractions(routing), scores.double().mean(0),
                      ops.confidence_entropy(probs).view(1)])


def test_one_forward_gives_the_figures_a_study_recorded():
    stats = SelectionStats(E)
    forward = _forward(40, seed=1)
    stats.add(*forward)
    stats.add_aux(torch.tensor(0.25))
    got = stats.figures()
    assert got.dtype == torch.float64
    torch.testing.assert_close(got[:-1], _definitions([forward]), rtol=1e-6, atol=1e-7)
    assert got[-1].item() == 0.25


def test_figures_pool_every_forward_since_the_last_read_then_reset():
    stats = SelectionStats(E)
    forwards = [_forward(t, seed=s) for t, s in ((40, 1), (7, 2), (64, 3))]  # unequal micro-batches
    for f, aux in zip(forwards, (0.1, 0.2, 0.6)):
        stats.add(*f)
        stats.add_aux(torch.tensor(aux, dtype=torch.float64))
    got = stats.figures()
    torch.testing.assert_close(got[:-1], _definitions(forwards), rtol=1e-6, atol=1e-7)
    assert got[-1].item() == pytest.approx(0.3, rel=1e-12)  # the mean over micro-batches
    # the last forward alone is not what a step of three micro-batches reports
    assert not torch.allclose(got[:-1], _definitions(forwards[-1:]), rtol=1e-3)
    stats.reset()
    assert torch.equal(stats.figures(), torch.zeros(2 * E + 2, dtype=torch.float64))
    stats.add(*forwards[1])
    torch.testing.assert_close(stats.figures()[:-1], _definitions(forwards[1:2]), rtol=1e-6, atol=1e-7)


def test_float64_inputs_stay_float64_and_counts_stay_exact_past_fp32():
    stats = SelectionStats(E)
    forward = _forward(33, seed=4, dtype=torch.float64)
    stats.add(*forward)
    torch.testing.assert_close(stats.figures()[:-1], _definitions([forward]), rtol=1e-13, atol=0)
    stats = SelectionStats(2)
    ones = torch.ones(2**22, 2, dtype=torch.bool)
    for _ in range(5):  # 5 * 2^22 selections per expert: past 2^24, where fp32 stops counting 1s
        stats.add(ones, torch.full((1, 2), 0.5), torch.zeros(1, 2))
    stats.add(torch.tensor([[True, False]]), torch.full((1, 2), 0.5), torch.zeros(1, 2))
    counts = stats._sums[:2]
    assert counts.tolist() == [5 * 2**22 + 1, 5 * 2**22]


class _CountMatmuls(TorchDispatchMode):
    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.legs
def test_the_moe_baselines_figures_come_from_its_own_logits_with_one_matmul(megatron_world):
    """megatron-core's TopKRouter (the study's moe arm) with the statistics attached, in training:
    one gating matmul per forward (the forward hook it replaces ran a second), and the figures of
    the softmax over all its logits, as before."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from aoe_megatron.models.stock_router import PaperTopKRouter
    from aoe_megatron.train.metrics import attach_stock_router_stats, selection_stats

    tc = make_transformer_config(d_model=16, num_experts=E, top_k=K)
    tc.moe_router_dtype = "fp32"
    router = PaperTopKRouter(config=tc, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    model = torch.nn.ModuleDict({"router": router})
    first = attach_stock_router_stats(model)
    assert attach_stock_router_stats(model) == first  # attached once, however often asked
    router.train()
    xs = [torch.randn(12, 1, 16) for _ in range(2)]
    for x in xs:
        with _CountMatmuls() as counted:
            router(x)
        assert counted.count == 1
    with torch.no_grad():
        logits = torch.cat([router.gating(x).reshape(-1, E).float() for x in xs])
        routing = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, logits.topk(K, -1).indices, True)
    want = torch.cat([ops.load_fractions(routing), logits.double().mean(0),
                      ops.confidence_entropy(torch.softmax(logits.double(), -1)).view(1)])
    got = selection_stats(model, first)[1]
    torch.testing.assert_close(torch.tensor([*got["load"], *got["mean_norm"], got["ent_conf"]],
                                            dtype=torch.float64), want, rtol=1e-5, atol=1e-6)
    assert selection_stats(model, first)[1]["load"] == [0.0] * E  # read, then reset
