"""Aux-loss-free balancing (issue #25): megatron-core's expert bias for the stock MoE and AoE's
bias on the norms, updated by our loop (``train.balance``), against references written from the
method (DeepSeek-V3; Algorithm 2 with the top-K chosen by p + b)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.helpers import (
    build_aoe_layer,
    make_transformer_config,
    read_aux,
    reference_aoe,
    run_distributed,
    singleton_pg_collection,
)

D, E, K, R, W = 16, 4, 2, 6, 20


def _aoe_layer(dtype=torch.float32, ep=1, pg_collection=None, **aoe):
    tc = make_transformer_config(d_model=D, num_experts=E, top_k=K, alpha_aux=0.01, dtype=dtype,
                                 ep=ep)
    return build_aoe_layer(tc, pg_collection=pg_collection, d_low=R, d_wide=W, expert_bias=True,
                           **aoe)


@pytest.mark.parametrize("selection", ["topk_softmax", "softmax_topk"])
def test_aoe_norm_bias_changes_the_choice_only(seeded, selection):
    """Forward and backward against the float64 per-token Algorithm 2 with the top-K chosen by
    p + b: the weights (softmax over the unbiased selected norms) and L_aux from p."""
    layer = _aoe_layer(torch.float64, selection=selection)
    bias = torch.tensor([0.0, 0.6, -0.4, 0.1], dtype=torch.float64)
    layer.router.expert_bias.copy_(bias)
    x, g = torch.randn(6, 3, D, dtype=torch.float64), torch.randn(6, 3, D, dtype=torch.float64)
    xs = x.clone().requires_grad_(True)
    out, _ = layer(xs)
    ((out * g).sum()).backward()

    params = {"w_down": layer.router.weight, "w_up": layer.experts.w_up,
              "w_p": layer.experts.w_p, "w_o": layer.experts.w_o}
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    xr = x.clone().requires_grad_(True)
    r_out, r_aux = reference_aoe(xr.reshape(-1, D), ref["w_down"], ref["w_up"], ref["w_p"],
                                 ref["w_o"], top_k=K, selection=selection, alpha_aux=0.01,
                                 bias=bias)
    ((r_out.reshape(x.shape) * g).sum() + r_aux).backward()
    unbiased, _ = reference_aoe(x.reshape(-1, D), *(p.detach() for p in params.values()), top_k=K,
                                selection=selection)
    assert not torch.allclose(unbiased, r_out)  # the bias changed some token's experts
    tol = dict(rtol=1e-10, atol=1e-10)
    assert_close(out.detach().reshape(-1, D), r_out.detach(), **tol)
    assert_close(read_aux(layer.router), r_aux.detach(), **tol)
    assert_close(xs.grad, xr.grad, **tol)
    for name, p in params.items():
        assert_close(p.grad, ref[name].grad, **tol, msg=name)
    chosen = torch.topk(_norms(layer, x) + bias, K).indices
    counts = torch.zeros(E, dtype=torch.float64).scatter_add_(0, chosen.reshape(-1),
                                                              torch.ones(chosen.numel(), dtype=torch.float64))
    assert_close(layer.router.local_tokens_per_expert.double(), counts, rtol=0, atol=0)


def _norms(layer, x):
    cache = x.reshape(-1, D) @ layer.router.weight.detach()
    return cache.view(-1, E, R).norm(dim=-1)


def test_the_update_is_megatron_cores(megatron_world):
    """Our update without its all-reduce equals megatron-core's get_updated_expert_bias (one rank)."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    from aoe_megatron.moe.ops import updated_expert_bias

    tokens = torch.tensor([[10.0, 3.0, 7.0, 4.0], [6.0, 6.0, 6.0, 6.0]])
    bias = torch.tensor([[0.1, -0.2, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]])
    ours = updated_expert_bias(bias, tokens, 0.01)
    assert_close(ours, get_updated_expert_bias(tokens.clone(), bias, 0.01), rtol=0, atol=0)
    assert_close(ours[0], torch.tensor([0.09, -0.19, 0.0 - 0.01, 0.31]))  # mean 6: 10,7 down; 3,4 up
    assert_close(ours[1], bias[1])  # balanced: no move


def _skewed_stock_router():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from aoe_megatron.models.stock_router import PaperTopKRouter

    tc = make_transformer_config(d_model=D, num_experts=E, top_k=K)
    tc.moe_router_score_function, tc.moe_router_enable_expert_bias = "sigmoid", True
    tc.moe_router_bias_update_rate, tc.moe_router_dtype = 0.02, "fp32"
    router = PaperTopKRouter(config=tc, pg_collection=get_default_pg_collection())
    with torch.no_grad():
        router.weight *= 20  # logits spread over a few units, as a trained router's
        router.weight[0] += 0.5  # expert 0 scores high for every token (inputs with mean 1)
    return router, lambda x: router(x + 1.0)[1]


def _skewed_aoe_router():
    layer = _aoe_layer(bias_update_rate=0.02)
    with torch.no_grad():
        layer.router.weight[:, :R] *= 3.0  # expert 0's cache, and norm, three times larger
    return layer.router, lambda x: layer.router(x)[1]


@pytest.mark.parametrize("kind", ["stock", "aoe"])
def test_each_bias_moves_the_load_toward_balance(seeded, kind):
    """A router whose expert 0 wins every token: a few updates later the load is far more even."""
    from aoe_megatron.train.balance import biased_routers, step_loads, update_biases

    router, routing = {"stock": _skewed_stock_router, "aoe": _skewed_aoe_router}[kind]()
    router.train()
    x = torch.randn(64, 2, D)

    def imbalance():  # the busiest expert's load over the mean, on fresh tokens, no update
        with torch.no_grad():
            load = routing(torch.randn(256, 2, D)).sum(0).float()
        return (load.max() / load.mean()).item()

    before = imbalance()
    routers = biased_routers(router)
    assert routers == [router]
    for _ in range(40):
        with torch.enable_grad():
            routing(x)
        loads = step_loads(routers)
        assert loads.sum() == 64 * 2 * K
        update_biases(routers, loads, applied=True)
        assert router.local_tokens_per_expert.sum() == 0
    after = imbalance()
    assert before > 1.8 and after < 1.4, (before, after)
    assert router.expert_bias[0] < 0 and router.expert_bias.dtype == torch.float32
    update_biases(routers, step_loads(routers) + 1, applied=False)  # a skipped step: no move
    assert router.expert_bias[0] < 0


def _ep_equals_ep1(rank, world_size):
    """Three steps of the loop's update at EP=2 and EP=1 (both over the two ranks' tokens, the
    counts summed in the step's fused all-reduce): the same biases and outputs."""
    from aoe_megatron.train.balance import biased_routers, step_loads, update_biases
    from aoe_megatron.train.step import agree_on_step

    layers = {}
    for ep, pgc in ((2, None), (1, singleton_pg_collection(rank, world_size))):
        torch.manual_seed(3)
        layers[ep] = _aoe_layer(ep=ep, pg_collection=pgc, bias_update_rate=0.05)
        with torch.no_grad():
            layers[ep].router.weight[:, :R] *= 3.0
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 2, D, generator=gen)
        outs = {}
        for ep, layer in layers.items():
            out, _ = layer(x)
            out.sum().backward()
            routers = biased_routers(layer)
            loads = step_loads(routers)
            mean, _, _ = agree_on_step(out.detach().mean(), stop_raised=False, loads=loads)
            update_biases(routers, loads, applied=True)
            outs[ep] = out.detach()
        assert_close(outs[2], outs[1], rtol=1e-5, atol=1e-6, msg=f"step {step} output")
        assert_close(layers[2].router.expert_bias, layers[1].router.expert_bias, rtol=0, atol=0)
    bias = layers[2].router.expert_bias.clone()
    assert bias.abs().sum() > 0
    dist.broadcast(bias, src=0)
    assert_close(layers[2].router.expert_bias, bias, rtol=0, atol=0)  # the same on every rank


@pytest.mark.distributed
def test_aoe_bias_at_ep2_equals_ep1():
    run_distributed(_ep_equals_ep1, 2)


def test_presets_and_config_errors():
    from aoe_megatron.models.gpt import load_preset

    with pytest.raises(ValueError, match="needs router.score_function: sigmoid"):
        load_preset("tiny", arch="moe", expert_bias=True)
    with pytest.raises(ValueError, match="apply to megatron-core's TopKRouter"):
        load_preset("tiny", arch="moe", expert_bias=True,
                    router={"score_function": "sigmoid", "gate": "two_layer", "hidden_per_expert": 4})
    with pytest.raises(ValueError, match="expert_bias biases the top-K choice"):
        load_preset("tiny", expert_bias=True, aoe={"selection": "top_p"})


BIAS_RUNS = {"aoe": (2, ["--set", "expert_bias=true"]),
             "moe": (1, ["--arch", "moe", "--set", "expert_bias=true", "--set",
                         "router.score_function=sigmoid", "--set", "alpha_aux=0"])}


def _bias_run(out, arch: str, *extra, save: bool = True) -> list:
    """The tiny ``arch`` with an expert bias through the real loop, 3 steps; its train lines."""
    import json
    from pathlib import Path

    from aoe_megatron.runtime import launch
    from tests.helpers import tiny_run_args

    nproc, flags = BIAS_RUNS[arch]
    done = launch.run([*tiny_run_args(train_iters=3, expert_model_parallel_size=nproc, eval_interval=0,
                                      save_interval=3 if save else 0, zero_stage=1),
                       "--set", "bias_update_rate=0.01", *flags, *extra,
                       *(["--save", out / arch] if save else []), "--run-dir", out / f"run_{arch}"],
                      nproc=nproc, cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.output[-4000:]
    lines = [json.loads(x) for x in (out / f"run_{arch}" / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


@pytest.fixture(scope="module")
def bias_runs(tmp_path_factory):
    """Both archs' 3-step runs (AoE at world 2 / EP 2, the stock MoE at world 1), once per module:
    {"out": folder (checkpoints in out/<arch>), arch: train lines}."""
    out = tmp_path_factory.mktemp("bias_runs")
    return {"out": out, **{arch: _bias_run(out, arch) for arch in BIAS_RUNS}}


@pytest.mark.slow
@pytest.mark.distributed
def test_the_loop_updates_both_biases_saves_them_and_they_reshard(bias_runs, megatron_world):
    """Through the real loop: the tiny AoE at world 2 / EP 2 and the stock MoE (sigmoid scores,
    expert bias) at world 1, three steps each. Every layer's bias has moved (the loop updated it,
    the same on both ranks) and is in the checkpoint; the EP=2 checkpoint loads at EP=1 in this
    process with the biases it saved."""
    from aoe_megatron.hf.checkpoint_io import CheckpointReader
    from tests.helpers import megatron_model

    for arch in BIAS_RUNS:
        step = bias_runs["out"] / arch / "step_00000003"
        saved = CheckpointReader(step).read("decoder.layers.mlp.router.expert_bias")  # [L, E]
        assert saved.shape[-1] == 4 and (saved.abs().sum(-1) > 0).all(), saved  # steps of +-0.01
        assert saved.abs().max() <= 0.03 + 1e-6 and saved.dtype == torch.float32
        model = megatron_model(step)  # EP=1 here
        loaded = torch.stack([layer.mlp.router.expert_bias for layer in model.decoder.layers])
        assert_close(loaded, saved.reshape(loaded.shape), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_moe_layer_recompute_at_ep2_changes_no_loss_and_counts_once(bias_runs, tmp_path):
    """``--moe-layer-recompute`` through the trainer at EP 2 (DeepSpeed ZeRO-1): both all-to-alls
    replayed in backward change no loss, and the step's L_aux and expert-bias token counts are
    taken once (the checkpointed first forward runs without gradients and counts nothing; the
    replay counts)."""
    from aoe_megatron.models.gpt import load_preset
    from tests.helpers import TINY_RUN

    model = load_preset("tiny")
    plain = bias_runs["aoe"]
    recomputed = _bias_run(tmp_path, "aoe", "--moe-layer-recompute", save=False)
    assert [x["step"] for x in plain] == [x["step"] for x in recomputed] == [1, 2, 3]
    tokens = TINY_RUN["global_batch_size"] * model.seq_length * model.top_k  # both ranks
    for a, b in zip(plain, recomputed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7), (a, b)
        assert a["aux_loss"] is not None and a["aux_loss"] > 0
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-6), (a, b)
        assert a["bias_tokens"] == b["bias_tokens"] == [tokens] * model.num_layers, (a, b)
