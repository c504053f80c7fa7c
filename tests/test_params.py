"""Parameter counts of the paper's models (Sections 4.1.1 and 4.2), computed without allocation."""

from __future__ import annotations

import json

import pytest

from aoe_megatron.models.gpt import load_preset
from aoe_megatron.cli.count_params import main
from aoe_megatron.models.params import count_parameters


@pytest.mark.parametrize("arch", ["moe", "aoe"])
@pytest.mark.parametrize("preset,total,active", [("732m", 732e6, 247e6), ("4b", 4e9, 1.18e9)])
def test_paper_counts_within_one_percent(preset, total, active, arch):
    counts = count_parameters(load_preset(preset, arch=arch))
    assert counts.total == pytest.approx(total, rel=0.01)
    assert counts.active == pytest.approx(active, rel=0.01)


def test_aoe_reports_the_all_expert_w_down_separately():
    counts = count_parameters(load_preset("732m", arch="aoe"))
    assert counts.per_layer["d_wide"] == 3840
    # All 8 experts compute x W_down; 6 unselected slices of 768 x 256 per layer on top.
    assert counts.active_with_all_caches - counts.active == 12 * 6 * 768 * 256


def test_untied_embeddings_would_miss_the_paper():
    untied = count_parameters(load_preset("732m", arch="moe", tie_embeddings=False))
    assert untied.total > 1.03 * 732e6


def test_cli_prints_table_and_json(capsys):
    assert main(["732m"]) == 0
    out = capsys.readouterr().out
    assert "732.5M" in out and "247.4M" in out
    assert main(["4b", "--arch", "aoe", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["aoe"]["total"] == count_parameters(load_preset("4b")).total
