"""What each rank trains and validates on: micro-batches by global sample index, so a resumed
run (at any world size) sees exactly the same samples in each step."""

from __future__ import annotations

import torch

from aoe_megatron.data import index_cache
from aoe_megatron.data.blend import build_datasets
from aoe_megatron.train import console
from aoe_megatron.train.run import Run


def random_batch(index: int, micro: int, seq_length: int, vocab: int):
    gen = torch.Generator().manual_seed(1_000_003 * index + 17)
    return torch.randint(0, vocab, (micro, seq_length + 1), generator=gen)


def sample_counts(run: Run, dp_size: int) -> tuple:
    """(train, valid, test) samples the run reads at ``dp_size`` data-parallel ranks: they decide
    the datasets' indices (and so their cache files)."""
    cfg = run.cfg
    # validation reads eval_iters batches at each evaluation (none with --eval-interval 0); the
    # test split is never read: a split asked for 0 samples is not built.
    evals = (run.steps // cfg.eval_interval + 1) if cfg.eval_interval else 0
    per_eval = cfg.eval_iters * cfg.micro_batch_size * dp_size
    return run.steps * cfg.global_batch_size, per_eval * evals, 0


def build_run_datasets(run: Run, dp_size: int, say=None) -> tuple:
    """The run's (train, valid, test) datasets, their sample indices in the run's data index
    cache (``data/index_cache.py``; rank 0 says whether it built or reused them)."""
    import time

    import torch.distributed as dist

    cache = index_cache.default_path(run.cfg)
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    before, start = (index_cache.index_files(cache) if rank0 else {}), time.perf_counter()
    datasets = build_datasets(run.data, seq_length=run.model.seq_length, seed=run.cfg.seed,
                              num_samples=sample_counts(run, dp_size), manifests=run.manifests,
                              cache_dir=cache)
    if rank0:
        (say or console.say)(index_cache.describe(
            before, index_cache.index_files(cache), cache, time.perf_counter() - start))
    return datasets


class Batches:
    """Micro-batches by global sample index, so a resumed run sees exactly the same data."""

    def __init__(self, run: Run, dp_rank: int, dp_size: int):
        self.cfg, self.model_cfg = run.cfg, run.model
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.train = self.valid = None
        self.run_data = run.data is not None
        if run.data is not None:
            self.train, self.valid, _ = build_run_datasets(run, dp_size)

    def _take(self, dataset, start: int, count: int, salt: int) -> torch.Tensor:
        if dataset is None:
            if self.run_data:  # a split that was not built
                raise RuntimeError("a data split that was not built is read (a bug: "
                                   "train/run.py checks the splits that are read)")
            return random_batch(salt + start, count, self.model_cfg.seq_length,
                                 self.model_cfg.vocab_size)
        rows = [torch.as_tensor(dataset[start + i]["tokens"]).long() for i in range(count)]
        labels = [torch.as_tensor(dataset[start + i]["labels"]).long() for i in range(count)]
        # tokens[t + 1] == labels[t]: rebuild the (seq_length + 1) window.
        return torch.stack([torch.cat([r, l[-1:]]) for r, l in zip(rows, labels)])

    def train_batch(self, step: int, micro_index: int, grad_accum: int) -> torch.Tensor:
        m = self.cfg.micro_batch_size
        start = step * self.cfg.global_batch_size + (self.dp_rank * grad_accum + micro_index) * m
        return self._take(self.train, start, m, salt=0)

    def valid_batch(self, i: int) -> torch.Tensor:
        m = self.cfg.micro_batch_size
        start = (i * self.dp_size + self.dp_rank) * m
        return self._take(self.valid, start, m, salt=10**12)


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    device = next(model.parameters()).device
    inputs, labels = inputs.to(device), labels.to(device)
    position_ids = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
    return model(inputs, position_ids, None, labels=labels).float().mean()
