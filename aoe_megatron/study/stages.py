"""A staged study's schema: stages of run groups over the arm catalog, with learning-rate sweeps,
rates carried from an earlier stage, and per-group seeds (pure: no training, no files).

    stages:
      - name: tune
        train: {train_iters: 250, save_interval: 50}   # over the study's train: (and model:)
        minutes_per_run: 3       # the estimate for a time budget until a run of the stage finished
        checkpoints: delete      # after a run is evaluated: delete | keep
        groups:
          - arms: [moe, aoe]
            seeds: [1]
            sweep: {lr: [1.0e-3, 2.0e-3, 4.0e-3]}   # a grid over every key given
            extend_at_edge: true # a fourth rate (x2 or /2) where the best sits at an edge
          - {arms: [moe, sanity], seeds: [1, 2, 3], set: {lr: 2.0e-3}}
      - name: compare
        groups:
          - {arms: [moe, aoe], seeds: [1, 2, 3], from: tune}       # each at its best in tune
      - name: width
        model: {hidden_size: 256}
        groups:
          - arms: [moe, {best_of: [aoe, aoe_matched], stage: compare}]
            from: tune
            scale: {lr: 0.5}     # the carried rate halved

A run is (arm, overrides, seed); its id is the arm's name and the overrides' values
("moe-lr0.002-bias0.01"), its folder runs/<stage>/<id>/seed<k>. The same id in two groups of a
stage is one run. Setting ``lr`` also sets ``min_lr`` in the preset's min_lr / lr ratio.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

from aoe_megatron.models.gpt import merge_settings

SWEEP_KEYS = {"lr": ("train", "lr"), "bias_update_rate": ("model", "bias_update_rate")}
"""The settings a stage may sweep, carry or scale, and where each lives in a preset."""
SHORT = {"lr": "lr", "bias_update_rate": "bias"}
STAGE_KEYS = {"name", "description", "model", "train", "minutes_per_run", "checkpoints", "groups"}
GROUP_KEYS = {"arms", "seeds", "sweep", "extend_at_edge", "set", "from", "scale"}


class StageError(ValueError):
    """A stage that cannot run; the message names the stage and the key."""


@dataclass(frozen=True)
class ArmRef:
    """One arm of a group: a catalog name, or the better of several at an earlier stage."""
    name: str = ""
    best_of: tuple = ()
    stage: str = ""

    def __str__(self) -> str:
        return self.name or f"best of {'/'.join(self.best_of)} at {self.stage}"


@dataclass(frozen=True)
class Group:
    arms: tuple  # ArmRef
    seeds: tuple
    sweep: dict = field(default_factory=dict)
    extend_at_edge: bool = False
    set: dict = field(default_factory=dict)
    source: str = ""  # "from": the stage whose best settings each arm carries
    scale: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    name: str
    description: str
    model: dict
    train: dict
    groups: tuple
    minutes_per_run: float = 0.0
    checkpoints: str = "keep"

    def steps(self, base_train: dict) -> int:
        return int(merge_settings(base_train, self.train).get("train_iters", 0))


def run_id(arm: str, overrides: dict) -> str:
    parts = [arm] + [f"{SHORT[k]}{overrides[k]:g}" for k in sorted(overrides)]
    return "-".join(parts)


def apply_overrides(preset: dict, overrides: dict) -> dict:
    """``preset`` ({"model", "train"}) with the swept settings set; ``min_lr`` follows ``lr``."""
    out = copy.deepcopy(preset)
    for key, value in overrides.items():
        section, name = SWEEP_KEYS[key]
        if key == "lr":
            old_lr, old_min = out["train"].get("lr"), out["train"].get("min_lr")
            if old_lr and old_min is not None:
                out["train"]["min_lr"] = float(value) * float(old_min) / float(old_lr)
        out[section][name] = float(value)
    return out


def _values(where: str, key: str, raw) -> dict:
    if not isinstance(raw, dict):
        raise StageError(f"{where}: {key} must be a mapping of {sorted(SWEEP_KEYS)}")
    unknown = set(raw) - set(SWEEP_KEYS)
    if unknown:
        raise StageError(f"{where}: {key} names {sorted(unknown)}; it takes {sorted(SWEEP_KEYS)}")
    return raw


def _arm_ref(where: str, raw, catalog: set, earlier: list) -> ArmRef:
    if isinstance(raw, str):
        if raw not in catalog:
            raise StageError(f"{where}: unknown arm {raw!r} (the arms: {sorted(catalog)})")
        return ArmRef(name=raw)
    if isinstance(raw, dict) and set(raw) <= {"best_of", "stage"} and raw.get("best_of"):
        names = tuple(raw["best_of"])
        if set(names) - catalog:
            raise StageError(f"{where}: best_of names unknown arms {sorted(set(names) - catalog)}")
        if raw.get("stage") not in earlier:
            raise StageError(f"{where}: best_of needs the stage: an earlier stage ({earlier})")
        return ArmRef(best_of=names, stage=raw["stage"])
    raise StageError(f"{where}: an arm is a name or {{best_of: [names], stage: earlier stage}}, "
                     f"got {raw!r}")


def _group(where: str, raw, catalog: set, earlier: list, default_seeds: tuple) -> Group:
    if not isinstance(raw, dict) or set(raw) - GROUP_KEYS or not raw.get("arms"):
        raise StageError(f"{where}: a group is a mapping with arms: and optional "
                         f"{sorted(GROUP_KEYS - {'arms'})}, got {raw!r}")
    arms = tuple(_arm_ref(where, a, catalog, earlier) for a in raw["arms"])
    seeds = tuple(int(s) for s in raw.get("seeds", default_seeds))
    if len(set(seeds)) != len(seeds) or not seeds:
        raise StageError(f"{where}: seeds must be distinct and not empty: {list(seeds)}")
    sweep = {k: tuple(float(v) for v in vs) for k, vs in _values(where, "sweep", raw.get("sweep", {})).items()}
    source = raw.get("from", "")
    if source and source not in earlier:
        raise StageError(f"{where}: from: {source!r} is not an earlier stage ({earlier})")
    carried = _values(where, "scale", raw.get("scale", {}))
    if carried and not source:
        raise StageError(f"{where}: scale applies to settings carried by from:")
    fixed = _values(where, "set", raw.get("set", {}))
    if set(fixed) & set(sweep):
        raise StageError(f"{where}: {sorted(set(fixed) & set(sweep))} both set and swept")
    extend = bool(raw.get("extend_at_edge", False))
    if extend and len(sweep.get("lr", ())) < 2:
        raise StageError(f"{where}: extend_at_edge needs an lr sweep of two or more rates")
    return Group(arms=arms, seeds=seeds, sweep=sweep, extend_at_edge=extend,
                 set={k: float(v) for k, v in fixed.items()}, source=source,
                 scale={k: float(v) for k, v in carried.items()})


def parse_stages(raw: list, *, catalog: set, seeds: tuple, source: str) -> tuple:
    if not isinstance(raw, list) or not raw:
        raise StageError(f"{source}: stages must be a list of stages")
    stages, names = [], []
    for entry in raw:
        where = f"{source}: stage {entry.get('name', '?') if isinstance(entry, dict) else '?'}"
        if not isinstance(entry, dict) or set(entry) - STAGE_KEYS:
            raise StageError(f"{where}: unknown keys {sorted(set(entry) - STAGE_KEYS)} "
                             f"(allowed: {sorted(STAGE_KEYS)})" if isinstance(entry, dict)
                             else f"{where}: a stage is a mapping")
        name = str(entry.get("name") or "")
        if not name.replace("_", "").replace("-", "").isalnum() or name in names:
            raise StageError(f"{where}: a stage needs a unique name of letters, digits, - and _")
        if entry.get("checkpoints", "keep") not in ("keep", "delete"):
            raise StageError(f"{where}: checkpoints is keep or delete")
        groups = tuple(_group(f"{where}, group {i + 1}", g, catalog, names, seeds)
                       for i, g in enumerate(entry.get("groups") or []))
        if not groups:
            raise StageError(f"{where}: needs groups:")
        stages.append(Stage(name=name, description=str(entry.get("description", "")),
                            model=entry.get("model") or {}, train=entry.get("train") or {},
                            groups=groups, minutes_per_run=float(entry.get("minutes_per_run", 0)),
                            checkpoints=entry.get("checkpoints", "keep")))
        names.append(name)
    return tuple(stages)


def sweep_points(group: Group) -> list:
    """Every overrides dict of a group's grid (the fixed ``set:`` values in each)."""
    keys = sorted(group.sweep)
    return [{**group.set, **dict(zip(keys, values))}
            for values in itertools.product(*(group.sweep[k] for k in keys))]


def edge_extension(group: Group, best: dict) -> dict | None:
    """The fourth point of an lr sweep whose best (overrides) sits at an edge, else None."""
    if not group.extend_at_edge:
        return None
    rates = sorted(group.sweep["lr"])
    lr = best.get("lr")
    if lr == rates[0]:
        return {**best, "lr": lr * rates[0] / rates[1]}
    if lr == rates[-1]:
        return {**best, "lr": lr * rates[-1] / rates[-2]}
    return None


def carried(group: Group, best: dict) -> dict:
    """The overrides a ``from:`` group gives an arm whose best settings were ``best``."""
    out = {k: v * group.scale.get(k, 1.0) for k, v in best.items()}
    return {**out, **group.set}
