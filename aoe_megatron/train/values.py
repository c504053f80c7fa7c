"""Training settings as they were written: ``--set`` items and ``--inject-nonfinite``'s step
list as text, and ``train:`` keys under their old names (torch-free: the flags' module reads
them before anything loads)."""

from __future__ import annotations

from aoe_megatron.runtime.deprecations import renamed, upgrade_keys


def parse_overrides(items) -> dict:
    """["num_layers=4", "aoe.d_low=128"] -> {"num_layers": 4, "aoe": {"d_low": 128}}."""
    import yaml

    out: dict = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key:
            raise ValueError(f"model override {item!r} is not KEY=VALUE")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def parse_steps(text) -> tuple:
    """``"3,5"`` -> (3, 5): step numbers from 1, as logged. None or "" -> ()."""
    if text is None or str(text).strip() == "":
        return ()
    steps = []
    for item in str(text).split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--inject-nonfinite {text!r}: expected step numbers from 1, "
                             f"separated by commas (e.g. 3,5)")
        steps.append(int(item))
    return tuple(sorted(set(steps)))


#: Old ``train:`` key -> its name now, the Megatron-LM flag's (``runtime/deprecations.py``).
TRAIN_LEGACY_KEYS = renamed("train_key")


def upgrade_train_keys(section: dict, *, where: str = "train settings", warn: bool = True) -> dict:
    """A copy of a ``train:`` section (a preset's, a study's, a run's record) with old keys
    renamed to TRAIN_LEGACY_KEYS' new ones: each warns unless ``warn`` is False (a record read
    back); a section with both names of one setting is refused."""
    return upgrade_keys(section, "train_key", where=where, warn=warn)
