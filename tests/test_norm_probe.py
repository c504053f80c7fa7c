"""The norm probes: forced-expert losses against a float64 reference, Spearman against scipy, the
AoE probe end to end on a checkpoint of the real training entry point, the paper's Table 1 probe
on an exported Mixtral folder (router kept = the model's own loss; each node's selection against a
float64 hand computation), and the command line's bad inputs."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from aoe_megatron.checkpoint import layout
from aoe_megatron.study import hf_probe, probe
from tests.helpers import megatron_model, reference_aoe

ROOT = Path(__file__).resolve().parents[1]


def _cli():
    from aoe_megatron.cli import norm_probe

    return norm_probe


# ----------------------------------------------------------------------------- the math

def test_spearman_and_ranks_match_scipy():
    from scipy.stats import rankdata, spearmanr

    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 7))
    b = a * rng.choice([-1.0, 1.0]) + rng.normal(size=(40, 7))
    tied_a, tied_b = np.round(a), np.round(b * 2) / 2  # many ties
    for x, y in ((a, b), (tied_a, tied_b), (tied_a, b)):
        assert_close(probe.average_ranks(x), rankdata(x, axis=-1))
        want = np.array([spearmanr(x[i], y[i]).statistic for i in range(len(x))])
        assert_close(probe.spearman_rows(x, y), want, rtol=1e-12, atol=1e-12)
        assert probe.spearman(x, y) == pytest.approx(spearmanr(x.ravel(), y.ravel()).statistic, abs=1e-12)
    constant = np.ones((1, 5))
    assert np.isnan(probe.spearman_rows(constant, a[:1, :5])[0])  # scipy: nan too


def test_layer_metrics_at_the_limits():
    rng = np.random.default_rng(1)
    losses = rng.normal(size=(50, 4))
    best = probe.layer_metrics(-losses, losses)  # the largest norm is always the lowest loss
    assert best["spearman_mean"] == pytest.approx(1.0) and best["spearman_pooled"] == pytest.approx(1.0)
    assert best["top_norm_is_loss_best"] == 1.0 and best["loss_best_norm_rank_mean"] == 1.0
    assert best["forced_loss_by_norm_rank"] == sorted(best["forced_loss_by_norm_rank"])
    worst = probe.layer_metrics(losses, losses)
    assert worst["spearman_mean"] == pytest.approx(-1.0)
    assert worst["top_norm_is_loss_best"] == 0.0 and worst["loss_best_norm_rank_mean"] == 4.0
    assert best["chance_top"] == 0.25 and best["chance_rank_mean"] == 2.5
    assert best["oracle_loss"] == pytest.approx(losses.min(-1).mean())


# ----------------------------------------------------------------------------- forced experts

def _reference_losses(model, windows, force):
    """Per-token losses of ``model`` (converted to float64) with every AoE layer replaced by a
    per-token loop: Algorithm 2 (tests.helpers.reference_aoe), or expert j alone at weight 1 in
    the forced layer: (SiLU(x W_down^j W_up^j) * x W_p^j) W_o^j. Also each layer's cache norms."""
    norms, hooks = {}, []

    def hook_for(index):
        def hook(module, args, kwargs, output):
            x_SBD = args[0] if args else kwargs["hidden_states"]
            s, b, d = x_SBD.shape
            x_TD = x_SBD.reshape(-1, d)
            w_down, ex, r = module.router.weight, module.experts, module.aoe.d_low
            caches = [x_TD @ w_down[:, e * r : (e + 1) * r] for e in range(module.aoe.num_experts)]
            norms[index] = torch.stack([c.norm(dim=-1) for c in caches], -1).view(s, b, -1).transpose(0, 1)
            if force is not None and force[0] == index:
                j = force[1]
                out = torch.stack([(F.silu(x @ w_down[:, j * r : (j + 1) * r] @ ex.w_up[j]) * (x @ ex.w_p[j]))
                                   @ ex.w_o[j] for x in x_TD])
            else:
                out, _ = reference_aoe(x_TD, w_down, ex.w_up, ex.w_p, ex.w_o, top_k=module.aoe.top_k)
            return out.view_as(x_SBD), None

        return hook

    for i, layer in enumerate(model.decoder.layers):
        hooks.append(layer.mlp.register_forward_hook(hook_for(i), with_kwargs=True))
    inputs, labels = windows[:, :-1], windows[:, 1:]
    try:
        with torch.no_grad():
            logits = model(inputs, torch.arange(inputs.shape[1]).expand_as(inputs), None)
    finally:
        for h in hooks:
            h.remove()
    assert logits.dtype == torch.float64 and logits.shape[:2] == inputs.shape
    nll = -logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1))[..., 0]
    return nll.reshape(-1), {i: n.reshape(-1, n.shape[-1]) for i, n in norms.items()}


def test_forced_expert_losses_match_a_float64_reference(megatron_world):
    from aoe_megatron.models.gpt import build_gpt_model, load_preset, transformer_config

    cfg = load_preset("tiny", vocab_size=96, hidden_size=32, ffn_hidden_size=64, seq_length=12,
                      aoe={"d_low": 8})
    torch.manual_seed(0)
    model = build_gpt_model(cfg, transformer_config(cfg), use_te=False).eval()
    with torch.no_grad():  # std 0.02 weights barely move the loss: make the experts matter
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(15.0)
    windows = torch.randint(0, 96, (3, 13), generator=torch.Generator().manual_seed(1))
    cases = [None, (0, 1), (1, 3), (1, 0)]
    got = {}
    with probe.ExpertForcing(probe.aoe_layers(model)) as forcing:
        for case in cases:
            forcing.force, forcing.record = case, case is None
            got[case] = probe.token_losses(model, windows, seed=0)
            if case is None:
                got_norms = dict(forcing.norms)
    model.double()
    for case in cases:
        want, want_norms = _reference_losses(model, windows, case)
        assert_close(got[case].double(), want, rtol=1e-5, atol=1e-5, msg=f"forced {case}")
    for i, n in want_norms.items():
        assert_close(got_norms[i].double(), n, rtol=1e-5, atol=1e-6, msg=f"norms of layer {i + 1}")
    # the check can fail: the experts differ by far more than the tolerance
    assert (got[(1, 3)] - got[(1, 0)]).abs().max() > 1e-2
    assert (got[(0, 1)] - got[None]).abs().max() > 1e-2


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def aoe_checkpoint(trained_checkpoint):
    """The checkpoint folder of the session's tiny AoE model (trained 3 steps at EP=2; the probe
    loads it at world 1, EP=1)."""
    return trained_checkpoint("aoe").parent


@pytest.mark.slow
@pytest.mark.distributed
def test_probe_end_to_end_on_a_trained_checkpoint(aoe_checkpoint, corpus, tmp_path,
                                                  megatron_world, capsys):
    out = tmp_path / "probe" / "p.json"
    assert _cli().main([str(aoe_checkpoint), "--data", str(corpus["data"]), "--sequences", "3",
                        "--batch-size", "2", "--output", str(out)]) == 0
    assert "top-norm = loss-best" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert "Forced-expert norm probe" in out.with_suffix(".md").read_text()
    assert result["checkpoint"].endswith("step_00000003") and result["step"] == 3
    assert (result["num_layers"], result["num_experts"], result["top_k"]) == (2, 4, 2)
    assert result["tokens"] == 3 * 64 and result["sequences"] == 3 and result["seq_length"] == 64
    assert "forced" in result["intervention"] and result["data"] == str(corpus["data"])
    assert [m["layer"] for m in result["layers"]] == [1, 2]
    for m in result["layers"]:
        assert -1 <= m["spearman_mean"] <= 1 and -1 <= m["spearman_pooled"] <= 1
        assert 0 <= m["top_norm_is_loss_best"] <= 1 and 1 <= m["loss_best_norm_rank_mean"] <= 4
        assert len(m["forced_loss_by_norm_rank"]) == len(m["forced_loss_by_expert"]) == 4
        assert m["oracle_loss"] <= m["forced_loss_mean"]
        assert np.mean(m["forced_loss_by_norm_rank"]) == pytest.approx(m["forced_loss_mean"], rel=1e-6)
    # the unforced loss is the model's own held-out loss on the same windows
    windows = probe.heldout_windows(str(corpus["data"]), sequences=3, seq_length=64, seed=0)
    model = megatron_model(layout.resolve(aoe_checkpoint))
    with torch.no_grad():
        own = model(windows[:, :-1], torch.arange(64).expand(3, 64), None, labels=windows[:, 1:])
    assert result["unforced_loss"] == pytest.approx(own.double().mean().item(), rel=1e-6)


# ----------------------------------------------------------------------------- Table 1 (HF)

@pytest.fixture(scope="module")
def moe_export(corpus, tmp_path_factory, megatron_world):
    """A tiny stock-MoE checkpoint (initial weights, routers made decisive) and its Mixtral export."""
    from megatron.core import dist_checkpointing

    from aoe_megatron.hf.convert import export_to_hf
    from aoe_megatron.models.gpt import build_gpt_model, load_preset, transformer_config

    root = tmp_path_factory.mktemp("moe")
    cfg = load_preset("tiny", arch="moe")
    torch.manual_seed(0)
    model = build_gpt_model(cfg, transformer_config(cfg), use_te=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embedding" not in name:
                p.mul_(10.0)
    step = root / "ckpt" / "step_00000001"
    (step / "model").mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(step / "model"))
    state = {"step": 1, "consumed_samples": 0,
             "config": {"model": asdict(cfg), "train": {"data": str(corpus["data"])}},
             "layout": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 1}}
    (step / "state.json").write_text(json.dumps(state))
    (root / "ckpt" / "latest").write_text(step.name + "\n")
    return {"step": step, "hf": export_to_hf(step, root / "hf", log=None)}


def _hand_block(x_TD, block, *, node, weighting="norm"):
    """One MoE block with norm selection, token by token in float64."""
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    num_experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    outs, chosen = [], []
    for x in x_TD:
        acts, outputs = [], []
        for e in range(num_experts):
            g, u = gate_up[e, :width] @ x, gate_up[e, width:] @ x
            y = down[e] @ (F.silu(g) * u)
            acts.append({"gate": g, "up": u, "act": F.silu(g), "prod": F.silu(g) * u, "out": y}[node])
            outputs.append(y)
        norms = torch.stack([torch.sqrt((a * a).sum()) for a in acts])
        top = torch.topk(norms, block.gate.top_k).indices
        if weighting == "norm":
            w = torch.softmax(norms[top], 0)
        else:
            w = torch.softmax(block.gate.weight @ x, 0)[top]
            w = w / w.sum()
        outs.append(sum(w[k] * outputs[int(i)] for k, i in enumerate(top)))
        chosen.append(sorted(top.tolist()))
    return torch.stack(outs), chosen


def test_table1_node_selection_matches_a_float64_hand_computation(moe_export):
    from transformers import AutoModelForCausalLM

    # NOTE: transformers' grouped_mm experts refuse float64; the eager loop is the same math
    model = AutoModelForCausalLM.from_pretrained(moe_export["hf"], dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    blocks = hf_probe.moe_blocks(model)
    assert len(blocks) == 2 and type(model).__name__ == "MixtralForCausalLM"
    block = blocks[1]
    x = torch.randn(1, 10, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        router_out = block(x)
        for node, weighting in [(n, "norm") for n in hf_probe.NODES] + [("out", "router")]:
            with hf_probe.NormSelection([block], node=node, weighting=weighting) as sel:
                got = block(x)
            want, chosen = _hand_block(x[0], block, node=node, weighting=weighting)
            assert_close(got[0], want, rtol=1e-10, atol=1e-12, msg=f"{node}, {weighting} weights")
            assert 0 <= sel.agreement()["agreement_same_set"] <= 1 and sel.counts["tokens"] == 10
            assert not torch.allclose(got, router_out)  # the router was really replaced
        assert_close(block(x), router_out, rtol=0, atol=0)  # and restored


def test_table1_probe_keeps_the_models_own_loss(moe_export, corpus, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(max_tokens=24, max_docs=3, dtype="fp32", device="cpu")
    result = hf_probe.hf_probe(moe_export["hf"], corpus["src"], nodes=("prod", "out"), batch_size=1, **kw)
    assert [r["node"] for r in result["results"]] == ["router", "prod", "out"]
    shape = (result["model_type"], result["moe_blocks"], result["num_experts"], result["top_k"])
    assert shape == ("mixtral", 2, 4, 2)
    tokenizer = AutoTokenizer.from_pretrained(moe_export["hf"], trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(moe_export["hf"], dtype=torch.float32).eval()
    total, correct, count = 0.0, 0, 0
    for line in corpus["src"].read_text().splitlines()[:3]:
        ids = torch.tensor([tokenizer(json.loads(line)["text"])["input_ids"][:24]])
        with torch.no_grad():
            out = model(ids, labels=ids)
        total += out.loss.item() * (ids.shape[1] - 1)
        correct += int((out.logits[0, :-1].argmax(-1) == ids[0, 1:]).sum())
        count += ids.shape[1] - 1
    router = result["results"][0]
    assert router["tokens"] == result["tokens"] == count
    assert router["loss"] == pytest.approx(total / count, rel=1e-6) and router["accuracy"] == correct / count
    for row in result["results"][1:]:
        assert row["delta_loss"] == pytest.approx(row["loss"] - router["loss"])
        assert 0 <= row["agreement_same_set"] <= row["agreement_overlap"] <= 1
        assert row["loss"] != router["loss"]
    # padded batches give the same numbers
    padded = hf_probe.hf_probe(moe_export["hf"], corpus["src"], nodes=("prod",), batch_size=3, **kw)
    for a, b in zip(padded["results"], result["results"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["tokens"] == b["tokens"]
    table = hf_probe.markdown(result)
    assert "Performance w. Router" in table and "prod: SiLU(x W_g) * x W_p" in table
    # the command line, every node
    out = tmp_path / "t1.json"
    assert _cli().main(["--hf", str(moe_export["hf"]), "--text", str(corpus["src"]), "--node", "all",
                        "--max-tokens", "12", "--max-docs", "2", "--dtype", "fp32",
                        "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["node"] for r in rows] == ["router", "gate", "up", "act", "prod", "out", "random"]
    # the random baseline: K experts drawn per token from a fixed generator (the same each run)
    again = hf_probe.hf_probe(moe_export["hf"], corpus["src"], nodes=("random",), max_tokens=12,
                              max_docs=2, dtype="fp32")["results"][1]
    assert again["node"] == "random" and again["loss"] == pytest.approx(rows[-1]["loss"], rel=1e-6)
    assert again["agreement_same_set"] < 1.0
    assert "| Performance w. Router |" in out.with_suffix(".md").read_text()
    assert "| out: experts' final outputs |" in capsys.readouterr().out


def test_table1_probe_on_olmoe(moe_export, corpus, tmp_path):
    """OLMoE's layout (no renormalisation of the top-K router weights): a random tiny model with
    the exported folder's tokenizer."""
    import shutil

    from transformers import AutoTokenizer, OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=32000, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=64,
                         initializer_range=0.3)
    model = OlmoeForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.model", "tokenization_aoe.py", "tokenizer_config.json"):
        shutil.copyfile(moe_export["hf"] / name, tmp_path / name)
    result = hf_probe.hf_probe(tmp_path, corpus["src"], nodes=("gate",), weighting="router", max_tokens=16,
                               max_docs=2, batch_size=1, dtype="fp32", device="cpu")
    assert result["model_type"] == "olmoe" and result["moe_blocks"] == 2
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    lines = corpus["src"].read_text().splitlines()[:2]
    total = count = 0
    for line in lines:
        ids = torch.tensor([tokenizer(json.loads(line)["text"])["input_ids"][:16]])
        with torch.no_grad():
            total += model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    router, gate = result["results"]
    assert router["loss"] == pytest.approx(total / count, rel=1e-6)
    assert gate["loss"] != router["loss"] and 0 <= gate["agreement_top1"] <= 1
    # router weights without renormalisation: the block's sums of weights are below one
    block = hf_probe.moe_blocks(model)[0]
    with hf_probe.NormSelection([block], node="gate", weighting="router"):
        _, weights_TK, _ = block.gate(torch.randn(5, 32))
    assert (weights_TK.sum(-1) < 1 - 1e-3).all()


# ----------------------------------------------------------------------------- bad input

def test_command_line_refuses_bad_input(moe_export, corpus, tmp_path, capsys):
    cli = _cli()
    data = str(corpus["data"])
    cases = [
        ([str(tmp_path), "--data", data], "is not a checkpoint"),
        ([str(tmp_path / "nope"), "--data", data], "does not exist"),
        ([str(moe_export["step"].parent), "--data", data], "is a traditional MoE (arch 'moe')"),
        (["--hf", str(moe_export["hf"]), "--text", str(tmp_path / "none.jsonl")], "does not exist"),
        (["--hf", str(moe_export["hf"]), "--text", str(corpus["src"]), "--node", "gate,bogus"],
         "unknown node(s) ['bogus']"),
        (["--hf", str(moe_export["step"]), "--text", str(corpus["src"])], "not a Hugging Face model folder"),
    ]
    for argv, phrase in cases:
        assert cli.main(argv) == 2, argv
        assert phrase in capsys.readouterr().err, argv
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    assert cli.main(["--hf", str(moe_export["hf"]), "--text", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:2 is not a JSON object with a 'text' field" in capsys.readouterr().err
    for argv, phrase in [(["--hf", str(moe_export["hf"])], "--hf needs --text"),
                         ([str(moe_export["step"])], "needs --data"),
                         ([], "give either an AoE CHECKPOINT")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2 and phrase in capsys.readouterr().err
