"""A study spec (YAML under run/studies/): one model and training recipe, the arms that differ from
it, the seeds, the held-out evaluation and the probe; ``quick:`` shrinks it for tests.

    name: default
    data: run/data-study.yaml
    model: {...}            # ModelConfig fields every arm shares
    train: {...}            # TrainConfig fields every arm shares (length, batch, lr, intervals)
    seeds: [1, 2, 3]
    baseline: moe           # the arm every other one is compared with, seed by seed
    compare_to: [aoe]       # more reference arms, each compared with every other arm likewise
    evaluation: {sequences: 256, batch_size: 8, seed: 0}
    probe: {arms: [aoe], sequences: 32, batch_size: 8}
    table1: {arm: moe, seed: 1, text: held-out.jsonl, documents: 100, max_tokens: 128}
    arms:
      - name: moe
        label: "MoE + L_aux (Table 2, Config 2)"
        model: {arch: moe}
      - name: aoe
        label: ...
        model: {arch: aoe, aoe: {d_low: 40}}
        world_size: 2             # processes (CPU slots) for this arm; default 1
        expert_parallel_size: 2
    quick: {seeds: [1, 2], arms: [moe, aoe], model: {...}, train: {...}, evaluation: {...}}
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from aoe_megatron.models.gpt import ModelConfig, math_revision, merge_settings
from aoe_megatron.models.settings import SECTIONS, upgrade_sections
from aoe_megatron.moe.config import LEGACY_KEYS
from aoe_megatron.runtime import resources
from aoe_megatron.study.stages import StageError, parse_stages
from aoe_megatron.train.values import TRAIN_LEGACY_KEYS, upgrade_train_keys

STUDY_DIR = resources.path("studies")
TOP_KEYS = {"name", "description", "data", "model", "train", "seeds", "baseline", "evaluation",
            "probe", "table1", "arms", "quick", "compare_to", "stages", "report"}
ARM_KEYS = {"name", "label", "model", "train", "world_size", "expert_parallel_size"}
QUICK_KEYS = {"seeds", "arms", "model", "train", "evaluation", "probe", "table1", "data", "stages"}
TABLE1_KEYS = {"arm", "seed", "text", "documents", "max_tokens", "batch_size", "stage"}


class SpecError(ValueError):
    """A study spec that cannot run; the message names the key."""


def _as_recorded(preset: dict) -> dict:
    """``preset`` with the settings' names its runs' fingerprints were first recorded with (the
    layers' LEGACY_KEYS, the ``train:`` keys' TRAIN_LEGACY_KEYS)."""
    old_of = {new: old for old, new in LEGACY_KEYS.items()}
    model = dict(preset.get("model") or {})
    for name in SECTIONS:
        if isinstance(model.get(name), dict):
            model[name] = {old_of.get(k, k): v for k, v in model[name].items()}
    out = {**preset, "model": model}
    if isinstance(preset.get("train"), dict):
        old_train = {new: old for old, new in TRAIN_LEGACY_KEYS.items()}
        out["train"] = {old_train.get(k, k): v for k, v in preset["train"].items()}
    return out


def _upgraded(section, where: str, upgrade=upgrade_sections):
    """A ``model:`` section (``upgrade=upgrade_train_keys``: a ``train:`` one) with old setting
    names renamed (each warns; both names: SpecError)."""
    if not isinstance(section, dict):
        return section
    try:
        return upgrade(section, where=where)
    except ValueError as err:
        raise SpecError(str(err)) from None


def _train_upgraded(train, where: str):
    return _upgraded(train, where, upgrade_train_keys)


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    preset: dict
    """The generated preset: {"model": {...}, "train": {...}} (the spec's shared sections merged
    with the arm's)."""
    world_size: int = 1
    expert_parallel_size: int = 1
    folder: str = ""
    """The run folder under runs/ (default: the name; a staged study's runs: <stage>/<run id>)."""

    @property
    def model(self) -> ModelConfig:
        return ModelConfig.from_dict(self.preset["model"])

    @property
    def revision(self) -> int:
        """The training math's revision for this arm (``models.gpt.math_revision``)."""
        return math_revision(self.model)

    def fingerprint(self, seed: int, data: str, *, revision: int | None = None) -> str:
        """Everything that decides a run's result: a finished run is reused only if it matches.
        ``revision``: the training math's (default: today's, ``revision``)."""
        # NOTE: a renamed setting is hashed under its old name (LEGACY_KEYS: "selection" as
        # "weight_mode"), and revision 1 is not hashed, so runs recorded before a rename, or
        # before a revision that left their arm alone, keep their fingerprints.
        fields = {"preset": _as_recorded(self.preset), "world_size": self.world_size,
                  "ep": self.expert_parallel_size, "seed": seed, "data": data}
        revision = self.revision if revision is None else revision
        if revision > 1:
            fields["math_revision"] = revision
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def mismatch(self, recorded: str, seed: int, data: str) -> str:
        """Why a run recorded with fingerprint ``recorded`` is not this arm's at ``seed``."""
        for old in range(1, self.revision):
            if recorded == self.fingerprint(seed, data, revision=old):
                return (f"it was trained under revision {old} of the training math, now "
                        f"{self.revision} (aoe_megatron.models.gpt.math_revision)")
        return (f"it was trained with another spec (fingerprint {recorded}, now "
                f"{self.fingerprint(seed, data)})")


@dataclass(frozen=True)
class Study:
    name: str
    data: str
    seeds: tuple
    baseline: str
    arms: tuple
    evaluation: dict = field(default_factory=dict)
    probe: dict = field(default_factory=dict)
    compare_to: tuple = ()
    """Reference arms besides the baseline (the report compares every other arm with each)."""
    table1: dict = field(default_factory=dict)
    """The paper's Table 1 probe on one run of a stock-MoE arm, exported to Hugging Face."""
    description: str = ""
    quick: bool = False
    stages: tuple = ()
    """A staged study's stages (``study.stages.Stage``); ``arms`` is then the catalog they use."""
    report: dict = field(default_factory=dict)
    """A staged study's report settings (``study.answers``)."""

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)


def spec_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return STUDY_DIR / f"{name_or_path}.yaml"


def load_study(name_or_path: str, *, quick: bool = False) -> Study:
    import yaml

    path = spec_path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in STUDY_DIR.glob("*.yaml")))
        raise SpecError(f"no study spec {name_or_path!r} (looked for {path}; known: {known})")
    raw = yaml.safe_load(path.read_text()) or {}
    return study_from_dict(raw, quick=quick, source=str(path))


def _check_keys(section: dict, allowed: set, where: str) -> None:
    if not isinstance(section, dict):
        raise SpecError(f"{where} must be a mapping, got {type(section).__name__}")
    unknown = set(section) - allowed
    if unknown:
        raise SpecError(f"unknown keys {sorted(unknown)} in {where} (allowed: {sorted(allowed)})")


def study_from_dict(raw: dict, *, quick: bool = False, source: str = "<dict>") -> Study:
    _check_keys(raw, TOP_KEYS, f"study {source}")
    raw = copy.deepcopy(raw)
    for key in ("name", "data", "arms", "seeds"):
        if not raw.get(key):
            raise SpecError(f"study {source} needs {key!r}")
    raw["model"] = _upgraded(raw.get("model"), f"{source}: model")
    raw["train"] = _train_upgraded(raw.get("train"), f"{source}: train")
    if quick:
        q = raw.get("quick") or {}
        _check_keys(q, QUICK_KEYS, f"{source}: quick")
        q["model"] = _upgraded(q.get("model"), f"{source}: quick.model")
        q["train"] = _train_upgraded(q.get("train"), f"{source}: quick.train")
        for key in ("model", "train", "evaluation", "probe", "table1"):
            raw[key] = merge_settings(raw.get(key) or {}, q.get(key) or {})
        raw["seeds"] = q.get("seeds", raw["seeds"])
        raw["stages"] = q.get("stages", raw.get("stages"))
        raw["data"] = q.get("data", raw["data"])
        if "arms" in q:
            names = {a.get("name") for a in raw["arms"]}
            missing = set(q["arms"]) - names
            if missing:
                raise SpecError(f"{source}: quick.arms names unknown arms {sorted(missing)}")
            raw["arms"] = [a for a in raw["arms"] if a.get("name") in q["arms"]]
    stages = ()
    for i, stage in enumerate(raw.get("stages") or []):
        if isinstance(stage, dict) and "train" in stage:
            stage["train"] = _train_upgraded(stage["train"], f"{source}: stage {i + 1}: train")
    if raw.get("stages"):
        try:
            stages = parse_stages(raw["stages"], catalog={a.get("name") for a in raw["arms"]},
                                  seeds=tuple(int(s) for s in raw["seeds"]), source=source)
        except StageError as err:
            raise SpecError(str(err)) from None
    report = raw.get("report") or {}
    names_of_stages = sorted(s.name for s in stages)
    for answer in report.get("answers") or []:
        at = answer.get("stage", report.get("stage"))
        if stages and not quick and at not in names_of_stages:  # quick specs may drop a stage
            raise SpecError(f"{source}: report answer {answer.get('key')!r} is at stage {at!r}, "
                            f"not one of {names_of_stages}")
    seeds = tuple(int(s) for s in raw["seeds"])
    if len(set(seeds)) != len(seeds):
        raise SpecError(f"{source}: seeds repeat: {list(seeds)}")
    arms = []
    for entry in raw["arms"]:
        _check_keys(entry, ARM_KEYS, f"{source}: arm {entry.get('name', '?')}")
        name = str(entry.get("name") or "")
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise SpecError(f"{source}: arm name {name!r} must be letters, digits, - and _")
        arm_model = _upgraded(entry.get("model"), f"{source}: arm {name}: model")
        preset = {"model": merge_settings(raw.get("model") or {}, arm_model or {}),
                  "train": merge_settings(raw.get("train") or {}, _train_upgraded(
                      entry.get("train") or {}, f"{source}: arm {name}: train"))}
        arm = Arm(name=name, label=str(entry.get("label", name)), preset=preset,
                  world_size=int(entry.get("world_size", 1)),
                  expert_parallel_size=int(entry.get("expert_parallel_size", 1)))
        try:
            arm.model  # invalid model settings fail here, naming the arm
        except (ValueError, TypeError) as err:
            raise SpecError(f"{source}: arm {name}: {err}") from None
        if arm.world_size % arm.expert_parallel_size:
            raise SpecError(f"{source}: arm {name}: expert_parallel_size {arm.expert_parallel_size} "
                            f"does not divide world_size {arm.world_size}")
        arms.append(arm)
    if len({a.name for a in arms}) != len(arms):
        raise SpecError(f"{source}: two arms share a name")
    baseline = str(raw.get("baseline") or arms[0].name)
    if baseline not in {a.name for a in arms}:
        raise SpecError(f"{source}: baseline {baseline!r} is not an arm")
    probe = raw.get("probe") or {}
    unknown = set(probe.get("arms", [])) - {a.name for a in arms}
    if unknown:
        probe["arms"] = [a for a in probe.get("arms", []) if a not in unknown]
    names = {a.name for a in arms}
    compare_to = tuple(c for c in (raw.get("compare_to") or []) if c in names and c != baseline)
    unknown = set(raw.get("compare_to") or []) - names
    if unknown and not quick:
        raise SpecError(f"{source}: compare_to names unknown arms {sorted(unknown)}")
    table1 = raw.get("table1") or {}
    if table1:
        _check_keys(table1, TABLE1_KEYS, f"{source}: table1")
        arm = next((a for a in arms if a.name == table1.get("arm")), None)
        if arm is None or arm.model.arch != "moe" or not arm.model.router.is_stock:
            raise SpecError(f"{source}: table1.arm must name a stock MoE arm (megatron-core's router), "
                            f"got {table1.get('arm')!r}")
        if int(table1.get("seed", seeds[0])) not in seeds or not table1.get("text"):
            raise SpecError(f"{source}: table1 needs a text (JSONL) and one of the seeds {list(seeds)}")
    return Study(name=str(raw["name"]) + ("-quick" if quick else ""), data=str(raw["data"]),
                 seeds=seeds, baseline=baseline, arms=tuple(arms), table1=table1, compare_to=compare_to,
                 evaluation=raw.get("evaluation") or {}, probe=probe,
                 description=str(raw.get("description", "")), quick=quick, stages=stages,
                 report=report)
