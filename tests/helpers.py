"""Test helpers: spawning gloo ranks, building AoE layers, the float64 reference of Algorithm 2,
the tiny training run's settings, and what several test files share (plain functions and
constants; shared fixtures live in conftest.py). No test file imports another test file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from aoe_megatron.runtime.spawn import spawn


def _megatron_rank(rank, fn, world_size, expert_parallel_size, args):
    torch.set_num_threads(1)
    from aoe_megatron.runtime.distributed import init_megatron, shutdown

    try:
        init_megatron(rank=rank, world_size=world_size, expert_parallel_size=expert_parallel_size)
        fn(rank, world_size, *args)
    finally:
        shutdown()


def run_distributed(fn, world_size: int, *args, expert_parallel_size: int | None = None,
                    timeout: float = 300.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (``runtime.spawn``);
    raises ``SpawnFailed`` with every failed rank's traceback.

    ``fn`` must be importable (a module-level function). Megatron's parallel state is set up with
    the given expert-parallel size (default: world_size).
    """
    ep = world_size if expert_parallel_size is None else expert_parallel_size
    spawn(_megatron_rank, world_size, fn, world_size, ep, args, timeout=timeout, what="gloo ranks")


def silu64(x):
    return F.silu(x)


def norm_of(c, order):
    if order == "l2":
        return torch.sqrt((c * c).sum())
    if order == "l1":
        return c.abs().sum()
    return c.abs().max()


def reference_aoe(x_TD, w_down_DER, w_up, w_p, w_o, *, top_k, norm="l2",
                  selection="topk_softmax", alpha_aux=0.0, bias=None):
    """Algorithm 2 written plainly, one token at a time, in float64.

    Returns (output [T, D], L_aux). Weights are global: w_up [E, R, W], w_p [E, D, W], w_o [E, W, D].
    ``bias`` [E] (aux-loss-free balancing): the K experts are those with the largest p_i + b_i;
    every weight and L_aux still come from the unbiased norms p.
    """
    num_experts, d_low = w_up.shape[0], w_up.shape[1]
    num_tokens = x_TD.shape[0]
    outputs, counts, prob_sums = [], [0.0] * num_experts, [0.0] * num_experts
    for t in range(num_tokens):
        x = x_TD[t]
        cache = [x @ w_down_DER[:, i * d_low : (i + 1) * d_low] for i in range(num_experts)]
        p = torch.stack([norm_of(c, norm) for c in cache])
        chosen = torch.topk(p if bias is None else p + bias, top_k).indices.tolist()
        p_all = torch.softmax(p, dim=0)
        if selection == "topk_softmax":
            weights = torch.softmax(p[chosen], dim=0)
        else:
            weights = p_all[chosen]
        h = torch.zeros_like(x)
        for j, i in enumerate(chosen):
            h = h + weights[j] * ((silu64(cache[i] @ w_up[i]) * (x @ w_p[i])) @ w_o[i])
            counts[i] += 1.0
        for i in range(num_experts):
            prob_sums[i] = prob_sums[i] + p_all[i]
        outputs.append(h)
    aux = sum((counts[i] / num_tokens) * (prob_sums[i] / num_tokens) for i in range(num_experts))
    return torch.stack(outputs), alpha_aux * num_experts * aux


def read_aux(router) -> torch.Tensor:
    """The L_aux of ``router``'s training forwards since the last read (their mean: a test reads it
    after each), then reset; in the router's dtype where wider than fp32 (float64 here)."""
    value = router.selection_stats.figures()[-1].clone()
    router.selection_stats.reset()
    return value


def make_transformer_config(*, d_model=16, d_ffn=32, num_experts=4, top_k=2, ep=1,
                            dispatcher="alltoall", alpha_aux=0.0, dtype=torch.float32,
                            num_layers=2):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=d_model, num_attention_heads=4, ffn_hidden_size=d_ffn,
        num_moe_experts=num_experts, moe_router_topk=top_k, expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=alpha_aux,
        use_cpu_initialization=True, params_dtype=dtype, add_bias_linear=False,
        moe_router_pre_softmax=top_k == 1, moe_ffn_hidden_size=d_ffn,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
    )


def build_aoe_layer(tc, *, pg_collection=None, layer_number=1, **aoe_fields):
    """An AoEMoELayer from a TransformerConfig plus AoE's own fields (and shared ones that
    override the TransformerConfig's, e.g. alpha_aux, expert_bias)."""
    from dataclasses import fields

    from megatron.core.transformer.spec_utils import build_module

    from aoe_megatron.moe.config import AoEConfig, AoELayerConfig
    from aoe_megatron.models.spec import aoe_mlp_spec

    own = {f.name for f in fields(AoEConfig)}
    aoe = AoELayerConfig.from_megatron(
        tc, AoEConfig(**{k: v for k, v in aoe_fields.items() if k in own}),
        **{k: v for k, v in aoe_fields.items() if k not in own})
    layer = build_module(aoe_mlp_spec(aoe), config=tc, layer_number=layer_number,
                         pg_collection=pg_collection)
    return layer.to(tc.params_dtype)


def load_tool(name: str):
    """tools/<name>.py as a module (the tools are scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the tiny run
#: The tiny run of tests/test_train.py and tests/test_kill.py: world 2 / EP 2 (two processes).
TINY_RUN = {"preset": "tiny", "expert_model_parallel_size": 2, "global_batch_size": 4,
            "micro_batch_size": 1, "lr_warmup_iters": 3, "lr": 3e-3, "eval_interval": 4,
            "eval_iters": 2, "log_interval": 1, "zero_stage": 2}


def tiny_run_args(**changes) -> list:
    """The entry point's flags for ``TINY_RUN`` with ``changes`` (settings by their preset keys:
    ``train_iters=8`` -> ``--train-iters 8``), on --mock-data: these runs test the machinery,
    not learning."""
    from aoe_megatron.train.flags import flag

    settings = {**TINY_RUN, **changes}
    return [*(x for key, value in settings.items() for x in (flag(key), str(value))), "--mock-data"]


TINY_RUN_ARGS = tiny_run_args()


# ----------------------------------------------------------------------------- shared pieces
def singleton_pg_collection(rank: int, world_size: int):
    """Process groups of this rank alone (an EP=1 layer inside a larger world); every rank must
    call it (``new_group`` is collective)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = [dist.new_group([r]) for r in range(world_size)]
    mine = groups[rank]
    pgc = ProcessGroupCollection()
    for name in ("ep", "tp", "cp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp"):
        setattr(pgc, name, mine)
    return pgc


def megatron_model(step_dir: Path):
    """The megatron-core model of a checkpoint step folder (its state record's config), in eval
    mode on the CPU, without TransformerEngine."""
    from aoe_megatron.checkpoint.model import load_model

    return load_model(step_dir, device="cpu", use_te=False)


def eval_rows(task: str, split: str, n: int) -> list[dict]:
    """n made-up examples in the schema of the task's Hub dataset."""
    rows = []
    for i in range(n):
        tag = f"{split} {i}"
        if task == "arc_easy":
            rows.append({"id": f"q{i}", "question": f"Which {tag} thing is hot?",
                         "choices": {"text": ["ice", "the sun", "snow", "water"], "label": ["A", "B", "C", "D"]},
                         "answerKey": "ABCD"[i % 4]})
        elif task == "piqa":
            rows.append({"goal": f"To open {tag} a jar", "sol1": "twist the lid", "sol2": "eat the lid",
                         "label": i % 2})
        elif task == "social_iqa":
            rows.append({"context": f"Alex {tag} helped Sam.", "question": "How does Sam feel?",
                         "answerA": "thankful", "answerB": "angry", "answerC": "bored",
                         "label": str(1 + i % 3)})
        elif task == "winogrande":
            rows.append({"sentence": f"The cup {tag} fell off the table because _ was wobbly.",
                         "option1": "the cup", "option2": "the table", "answer": str(1 + i % 2)})
        elif task == "hellaswag":
            rows.append({"ind": i, "activity_label": "Cooking", "ctx_a": f"A man {tag} cracks an egg.",
                         "ctx_b": "he", "ctx": f"A man {tag} cracks an egg. he",
                         "endings": ["fries it.", "sings.", "[title] runs away.", "sleeps."],
                         "source_id": "x", "split": split, "split_type": "indomain",
                         "label": str(i % 4)})
        elif task == "mnli":
            rows.append({"premise": f"The cat {tag} sleeps.", "hypothesis": "An animal rests.",
                         "label": i % 3, "idx": i})
        elif task == "qnli":
            rows.append({"question": f"Where {tag} is Paris?", "sentence": "Paris is in France.",
                         "label": i % 2, "idx": i})
        elif task == "sst2":
            rows.append({"sentence": f"{split} sentence {i} is {'wonderful' if i % 2 else 'awful'}",
                         "label": i % 2, "idx": i})
        elif task == "mrpc":
            rows.append({"sentence1": f"He {tag} left.", "sentence2": "He went away.", "label": i % 2,
                         "idx": i})
        elif task == "qqp":
            rows.append({"question1": f"How {tag} do I cook rice?", "question2": "How is rice cooked?",
                         "label": i % 2, "idx": i})
    return rows


_EACH_SCRIPT = """
import contextlib, importlib, io, json, sys
argument, modules, scripts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {}
for name, target in scripts.items():
    module, _, attr = target.partition(":")
    text = io.StringIO()
    code = None
    with contextlib.redirect_stdout(text):
        try:
            getattr(importlib.import_module(module), attr)([argument])
        except SystemExit as exit_:
            code = exit_.code
    out[name] = [code, text.getvalue(), sorted(m for m in modules if m in sys.modules)]
print(json.dumps(out))
"""


def each_console_script(argument: str, modules=("torch",), *, root: Path) -> dict:
    """Every console script of pyproject.toml called as ``main([argument])`` in one fresh
    interpreter: {name: [exit code, stdout, which of ``modules`` were loaded afterwards]}."""
    import subprocess
    import sys
    import tomllib

    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    done = subprocess.run([sys.executable, "-c", _EACH_SCRIPT, argument, json.dumps(list(modules)),
                           json.dumps(scripts)], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
