"""A Megatron-LM user's first day, the small stumbles (issue #36, item 3): --help without torch,
aoe-evaluate without its extra, a tokenizer-only fetch for an air-gapped cluster, aoe-checkpoints'
exit status on bad input, active above total explained, and the README's install wording. (The
Slurm template from an install: tests/test_slurm_template.py.)"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import each_console_script

ROOT = Path(__file__).resolve().parents[1]


def _scripts() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.legs
def test_no_command_imports_torch_to_print_help():
    """Each console script's main(["--help"]) in one fresh interpreter: torch is not in
    sys.modules after any of them (it used to take 1.5 s warm, 5-6 s after an install)."""
    results = each_console_script("--help", ("torch", "megatron.core"), root=ROOT)
    assert sorted(results) == sorted(_scripts())
    for name, (code, text, loaded) in results.items():
        assert code in (0, None) and f"usage: {name}" in text, (name, code, text[:300])
        assert loaded == [], f"{name} --help imported {loaded}"


def test_evaluate_without_the_eval_extra_names_it(monkeypatch, tmp_path, capsys):
    from aoe_megatron.cli.evaluate import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    for argv in ([str(tmp_path), "--data-dir", str(tmp_path), "--output", str(tmp_path / "out")],
                 ["fetch-data", "--data-dir", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "aoe-evaluate needs the eval extra (lm_eval is not installed)" in err, err
        assert 'pip install "aoe-megatron[eval]"' in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_:  # --help still answers
        main(["--help"])
    assert exit_.value.code == 0


def test_fetch_assets_tokenizer_only_fetches_no_corpus(monkeypatch, tmp_path, capsys):
    from aoe_megatron.cli import fetch_assets
    from aoe_megatron.data import assets, sources

    model = tmp_path / "assets" / "tokenizer" / "tok.model"
    fetched = []
    monkeypatch.setattr(assets, "fetch_tokenizer", lambda: fetched.append("tokenizer") or model)
    monkeypatch.setattr(assets, "build_corpus", lambda: fetched.append("corpus"))
    monkeypatch.setattr(sources, "DOWNLOADS", tmp_path / "downloads")
    assert fetch_assets.main(["--tokenizer-only"]) == 0
    assert fetched == ["tokenizer"]
    out = capsys.readouterr().out
    assert f"tokenizer: {model}" in out
    assert f"copy {model.parent} to DIR/tokenizer there and set AOE_MEGATRON_ASSETS=DIR" in out
    with pytest.raises(SystemExit) as exit_:
        fetch_assets.main(["--tokenizer-only", "--study"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_checkpoints_on_a_folder_without_checkpoints_exits_2(tmp_path, capsys):
    """The docs say 2 on bad input (it was 1, the status of a damaged checkpoint)."""
    from aoe_megatron.cli.checkpoints import main

    for command in ("list", "verify"):
        assert main([command, str(tmp_path)]) == 2
        assert "is neither a checkpoint nor a directory of step_* checkpoints" in \
            capsys.readouterr().err
        assert main([command, str(tmp_path / "missing")]) == 2
        assert "is not a directory" in capsys.readouterr().err


def test_count_params_says_why_active_exceeds_total(capsys):
    from aoe_megatron.cli.count_params import main

    assert main(["tiny", "--arch", "aoe"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("aoe "))
    assert float(row[2].rstrip("M")) > float(row[1].rstrip("M"))  # active above total
    assert ("the input embedding and the output layer are one tied [vocab x hidden] matrix "
            "(2.0M): counted once in total, twice in active") in out, out
    assert main(["tiny", "--json"]) == 0
    json.loads(capsys.readouterr().out)  # the JSON stays plain JSON


def test_readme_lists_every_command_and_says_where_the_wheel_comes_from():
    readme = (ROOT / "README.md").read_text()
    table = {m.group(1) for m in re.finditer(r"^\| `(aoe-[a-z-]+)` \|", readme, re.M)}
    assert table == set(_scripts()), sorted(set(_scripts()) ^ table)
    assert "pip install aoe-megatron (from a wheel)" not in readme  # not on a public index
    assert "pip install dist/aoe_megatron-*.whl" in readme
