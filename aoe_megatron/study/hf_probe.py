"""The paper's Table 1 (Section 3.1, "experts know what they know"): remove the routers of a
pre-trained MoE language model and let every expert run up to a "pause" node; the K experts with
the largest L2 norm at that node continue, the others stop. Reported here as the LM loss and
next-token accuracy on a text set against the model with its routers (the paper reports MMLU and
ARC-C accuracy), plus how often the norm picks the router's experts.

Nodes (the paper's names; W_g the gate projection, W_p the up projection, W_o the output):
    gate  x W_g            up  x W_p            act  SiLU(x W_g)
    prod  SiLU(x W_g) * x W_p (the FFN "key")   out  the expert's final output
Weights of the chosen experts: ``norm`` (default) softmax over their norms, as AoE's Algorithm 2
does once there is no router; ``router`` the router's own top-K weights (softmax over all logits,
renormalised over the chosen experts where the model renormalises). NOTE: raw norms can be large,
so "norm" weights are often nearly one-hot; "router" isolates the choice from the weighting.

Supports Hugging Face Mixtral and OLMoE folders (transformers' fused expert layout:
``gate_up_proj`` [E, 2F, D] = [W_g; W_p] transposed, ``down_proj`` [E, D, F]), e.g. a stock MoE
checkpoint exported by aoe-convert-to-hf.

Shape suffixes: T tokens, D d_model, E experts, K top-k, F expert width.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from aoe_megatron.study.checkpoints import StudyInputError as ProbeError
from aoe_megatron.study.probe_nodes import CHOICES, NODES, RANDOM, WEIGHTINGS

MODEL_TYPES = ("mixtral", "olmoe")
ROUTER = "router"  # the unmodified model


# ----------------------------------------------------------------------------- math

def node_norms(x_TD: torch.Tensor, *, gate_up_EFD: torch.Tensor, down_EDF: torch.Tensor,
               node: str, act: Callable = F.silu) -> torch.Tensor:
    """L2 norm of every expert's activation at ``node`` per token [T, E] (float32 at least); one
    expert at a time, so at most [T, 2F] is held."""
    if node not in NODES:
        raise ProbeError(f"unknown node {node!r}; choose from {', '.join(NODES)}")
    norms = []
    for e in range(gate_up_EFD.shape[0]):
        gate_TF, up_TF = F.linear(x_TD, gate_up_EFD[e]).chunk(2, dim=-1)
        h_TX = {"gate": lambda: gate_TF, "up": lambda: up_TF, "act": lambda: act(gate_TF),
                "prod": lambda: act(gate_TF) * up_TF,
                "out": lambda: F.linear(act(gate_TF) * up_TF, down_EDF[e])}[node]()
        h_TX = h_TX.float() if h_TX.dtype in (torch.float16, torch.bfloat16) else h_TX
        norms.append(torch.linalg.vector_norm(h_TX, dim=-1))
    return torch.stack(norms, dim=-1)


def norm_selection(norms_TE: torch.Tensor, *, top_k: int, weighting: str = "norm",
                   router_logits_TE: Optional[torch.Tensor] = None, renormalize: bool = True):
    """(weights_TK, index_TK): the top-K experts by norm; weights softmax over their norms
    ("norm") or the router's softmax probabilities of those experts ("router", renormalised to
    sum to 1 when ``renormalize``)."""
    index_TK = torch.topk(norms_TE, top_k, dim=-1).indices
    if weighting == "norm":
        weights_TK = torch.softmax(norms_TE.gather(-1, index_TK), dim=-1)
    elif weighting == "router":
        logits_TE = router_logits_TE.to(torch.promote_types(router_logits_TE.dtype, torch.float32))
        weights_TK = torch.softmax(logits_TE, dim=-1).gather(-1, index_TK)
        if renormalize:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    else:
        raise ProbeError(f"unknown weighting {weighting!r}; choose from {WEIGHTINGS}")
    return weights_TK, index_TK


# ----------------------------------------------------------------------------- plumbing

def moe_blocks(model) -> list:
    """Every sparse-MoE block (``gate`` router + fused ``experts``) of the model, checked."""
    blocks = [m for m in model.modules()
              if hasattr(m, "gate") and hasattr(getattr(m, "experts", None), "gate_up_proj")]
    for block in blocks:
        ex = block.experts
        if (getattr(ex, "is_transposed", False) or not getattr(ex, "is_concatenated", True)
                or getattr(ex, "has_bias", False) or ex.gate_up_proj.ndim != 3):
            raise ProbeError(f"{type(ex).__name__}: only the fused [E, 2F, D] gate_up_proj layout "
                             f"without biases is supported")
    if not blocks:
        raise ProbeError("no sparse-MoE block with a router and fused experts found in the model")
    return blocks


class NormSelection:
    """Patches every block's router: experts ranked by the norm at ``node``; records how often
    the norm choice agrees with the router's on the tokens of ``valid_T`` (set per batch)."""

    def __init__(self, blocks, *, node: str, weighting: str = "norm", seed: int = 0):
        if node not in CHOICES:
            raise ProbeError(f"unknown node {node!r}; choose from {', '.join(CHOICES)}")
        self.blocks, self.node, self.weighting = blocks, node, weighting
        self.generator = torch.Generator().manual_seed(seed)
        self.valid_T: Optional[torch.Tensor] = None
        self.counts = {"tokens": 0, "same_set": 0, "overlap": 0.0, "same_top1": 0}

    def __enter__(self):
        for block in self.blocks:
            block.gate.forward = self._wrap(block, block.gate.forward)
        return self

    def __exit__(self, *exc):
        for block in self.blocks:
            del block.gate.forward

    def _wrap(self, block, original):
        def forward(hidden_states):
            logits_TE, _, router_TK = original(hidden_states)
            x_TD = hidden_states.reshape(-1, block.experts.gate_up_proj.shape[-1])
            if self.node == RANDOM:
                norms_TE = torch.rand(x_TD.shape[0], block.experts.gate_up_proj.shape[0],
                                      generator=self.generator).to(x_TD.device)
            else:
                norms_TE = node_norms(x_TD, gate_up_EFD=block.experts.gate_up_proj, node=self.node,
                                      down_EDF=block.experts.down_proj, act=block.experts.act_fn)
            weights_TK, index_TK = norm_selection(
                norms_TE, top_k=router_TK.shape[-1], weighting=self.weighting, router_logits_TE=logits_TE,
                renormalize=getattr(block.gate, "norm_topk_prob", True))
            self._agreement(index_TK, router_TK, norms_TE.shape[-1])
            return logits_TE, weights_TK, index_TK

        return forward

    @torch.no_grad()
    def _agreement(self, mine_TK, router_TK, num_experts: int) -> None:
        mine_TE = torch.zeros(mine_TK.shape[0], num_experts, device=mine_TK.device).scatter(-1, mine_TK, 1.0)
        theirs_TE = torch.zeros_like(mine_TE).scatter(-1, router_TK, 1.0)
        keep = slice(None) if self.valid_T is None else self.valid_T.to(mine_TK.device)
        overlap_T = (mine_TE * theirs_TE).sum(-1)[keep]
        c = self.counts
        c["tokens"] += overlap_T.numel()
        c["same_set"] += int((overlap_T == mine_TK.shape[-1]).sum())
        c["overlap"] += float(overlap_T.sum()) / mine_TK.shape[-1]
        c["same_top1"] += int((mine_TK[:, 0] == router_TK[:, 0])[keep].sum())

    def agreement(self) -> dict:
        """Over (token, MoE block) pairs: the same expert set as the router, the mean share of
        the router's experts chosen, the same top-1 expert."""
        n = max(self.counts["tokens"], 1)
        return {"agreement_same_set": self.counts["same_set"] / n,
                "agreement_overlap": self.counts["overlap"] / n,
                "agreement_top1": self.counts["same_top1"] / n}


def read_documents(path, tokenizer, *, max_tokens: int, max_docs: Optional[int]) -> list:
    """Token ids of the JSONL file's ``text`` fields (the tokenizer's BOS policy), each cut to
    ``max_tokens``; documents under 2 tokens are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ProbeError(f"text file {path} does not exist")
    docs = []
    with open(path) as lines:
        for number, line in enumerate(lines, start=1):
            if max_docs and len(docs) >= max_docs:
                break
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ProbeError(f"{path}:{number} is not a JSON object with a 'text' field") from None
            ids = tokenizer(text)["input_ids"][:max_tokens]
            if len(ids) >= 2:
                docs.append(ids)
    if not docs:
        raise ProbeError(f"{path} has no document of 2 tokens or more")
    return docs


@torch.no_grad()
def lm_metrics(model, docs: list, *, batch_size: int, selection: Optional[NormSelection] = None,
               log=None) -> dict:
    """Mean next-token loss and accuracy over the documents (right-padded batches)."""
    device = next(model.parameters()).device
    loss_sum, correct, count = 0.0, 0, 0
    for start in range(0, len(docs), batch_size):
        batch = docs[start : start + batch_size]
        width = max(len(d) for d in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, d in enumerate(batch):
            ids[i, : len(d)], mask[i, : len(d)] = torch.tensor(d), 1
        ids, mask = ids.to(device), mask.to(device)
        if selection is not None:
            selection.valid_T = mask.reshape(-1).bool()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        labels, keep = ids[:, 1:], mask[:, 1:].bool()
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        loss_sum += float(losses[keep].double().sum())
        correct += int((logits.argmax(-1) == labels)[keep].sum())
        count += int(keep.sum())
    if log:
        log(f"{count} tokens: loss {loss_sum / count:.4f}")
    return {"loss": loss_sum / count, "accuracy": correct / count, "tokens": count}


def _load(folder: Path, dtype: str, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ProbeError(f"{folder} is not a Hugging Face model folder (no config.json)")
    kind = json.loads(config_path.read_text()).get("model_type")
    if kind == "aoe":
        raise ProbeError(f"{folder} is an AoE model: it has no router to remove; probe its training "
                         f"checkpoint with aoe-norm-probe CKPT --data DATA.yaml")
    if kind not in MODEL_TYPES:
        raise ProbeError(f"{folder} has model_type {kind!r}; the probe supports {MODEL_TYPES}")
    torch_dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
    # NOTE: trust_remote_code for the tokenizer only: our exports ship their sentencepiece code.
    return model, AutoTokenizer.from_pretrained(folder, trust_remote_code=True), kind


def hf_probe(folder, text, *, nodes=tuple(CHOICES), weighting: str = "norm", max_tokens: int = 512,
             max_docs: Optional[int] = 200, batch_size: int = 4, dtype: str = "auto", device=None,
             log: Optional[Callable[[str], None]] = None) -> dict:
    """Table 1 on a Hugging Face MoE folder: the router, then each node's norm selection."""
    folder = Path(folder)
    nodes = [n for n in nodes if n != ROUTER]  # the router always runs first, as the baseline
    unknown = [n for n in nodes if n not in CHOICES]
    if unknown or weighting not in WEIGHTINGS:
        raise ProbeError(f"unknown node(s) {unknown} or weighting {weighting!r}; nodes: "
                         f"{', '.join(CHOICES)}; weightings: {', '.join(WEIGHTINGS)}")
    if not Path(text).is_file():
        raise ProbeError(f"text file {text} does not exist")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer, kind = _load(folder, dtype, device)
    blocks = moe_blocks(model)
    docs = read_documents(text, tokenizer, max_tokens=max_tokens, max_docs=max_docs)
    if log:
        log(f"{len(docs)} documents, {len(blocks)} MoE blocks; running the router")
    base = lm_metrics(model, docs, batch_size=batch_size, log=log)
    rows = [{"node": ROUTER, "label": "Performance w. Router", **base, "delta_loss": 0.0,
             "delta_accuracy": 0.0, "agreement_same_set": 1.0, "agreement_overlap": 1.0,
             "agreement_top1": 1.0}]
    for node in nodes:
        if log:
            log(f"node {node} ({CHOICES[node]})")
        with NormSelection(blocks, node=node, weighting=weighting) as sel:
            got = lm_metrics(model, docs, batch_size=batch_size, selection=sel, log=log)
        rows.append({"node": node, "label": CHOICES[node], **got, "delta_loss": got["loss"] - base["loss"],
                     "delta_accuracy": got["accuracy"] - base["accuracy"], **sel.agreement()})
    first = blocks[0]
    return {"model": str(folder), "model_type": kind, "text": str(text), "documents": len(docs),
            "max_tokens": max_tokens, "tokens": base["tokens"], "moe_blocks": len(blocks),
            "num_experts": int(first.experts.gate_up_proj.shape[0]), "top_k": int(first.gate.top_k),
            "weighting": weighting, "norm": "l2", "dtype": str(next(model.parameters()).dtype),
            "results": rows}


def markdown(result: dict) -> str:
    lines = [
        f"Router-free expert selection (paper Table 1): {result['model']} ({result['model_type']}, "
        f"{result['moe_blocks']} MoE blocks, {result['num_experts']} experts, top-{result['top_k']}); "
        f"{result['tokens']} tokens of {result['documents']} documents from {result['text']}; "
        f"L2 norm, {result['weighting']} weights.",
        "",
        "| node | loss | delta loss | accuracy | delta acc | same experts as router | overlap | same top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        name = r["label"] if r["node"] == ROUTER else f"{r['node']}: {r['label']}"
        lines.append(f"| {name} | {r['loss']:.4f} | {r['delta_loss']:+.4f} | {r['accuracy']:.4f} | "
                     f"{r['delta_accuracy']:+.4f} | {r['agreement_same_set']:.3f} | "
                     f"{r['agreement_overlap']:.3f} | {r['agreement_top1']:.3f} |")
    ppl = ", ".join(f"{r['node']} {math.exp(min(r['loss'], 50)):.2f}" for r in result["results"])
    lines += ["", f"Perplexity: {ppl}"]
    return "\n".join(lines) + "\n"
