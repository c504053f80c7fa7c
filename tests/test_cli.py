"""The command line (aoe_megatron/cli/, issue #23): every console script resolves, every parser
refuses abbreviated flags and documents each flag, and an installed script runs."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: module under aoe_megatron.cli -> its console script
COMMANDS = {
    "preprocess": "aoe-preprocess",
    "train_tokenizer": "aoe-train-tokenizer",
    "convert_to_hf": "aoe-convert-to-hf",
    "convert_from_hf": "aoe-convert-from-hf",
    "evaluate": "aoe-evaluate",
    "checkpoints": "aoe-checkpoints",
    "bench": "aoe-bench",
    "bench_preprocess": "aoe-bench-preprocess",
    "study": "aoe-study",
    "norm_probe": "aoe-norm-probe",
    "mcnemar": "aoe-mcnemar",
    "ablation_table": "aoe-ablation-table",
    "count_params": "aoe-count-params",
    "fetch_assets": "aoe-fetch-assets",
    "verify_data": "aoe-verify-data",
}


def _scripts() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _cli(module: str):
    return importlib.import_module(f"aoe_megatron.cli.{module}")


def _parsers(ap: argparse.ArgumentParser):
    """The parser and, recursively, its subcommands' parsers."""
    yield ap
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _all_parsers(module: str) -> list:
    cli = _cli(module)
    found = list(_parsers(cli.parser()))
    if hasattr(cli, "fetch_parser"):  # aoe-evaluate fetch-data
        found += list(_parsers(cli.fetch_parser()))
    return found


def test_every_console_script_resolves_to_a_callable():
    scripts = _scripts()
    assert {name: f"aoe_megatron.cli.{m}:main" for m, name in COMMANDS.items()}.items() <= \
        scripts.items()
    assert scripts["aoe-train"] == "aoe_megatron.cli.train:main"
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


@pytest.mark.parametrize("module", list(COMMANDS))
def test_parsers_refuse_abbreviations_and_document_every_flag(module, capsys):
    prog = COMMANDS[module]
    for ap in _all_parsers(module):
        assert ap.prog.startswith(prog) and ap.allow_abbrev is False, ap.prog
        assert ap.description and ap.description.strip(), ap.prog
        for action in ap._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            names = set(action.option_strings) | {action.dest, action.metavar}
            assert action.help and action.help.strip() and action.help.strip() not in names, \
                (ap.prog, action.option_strings or action.dest)
            if action.option_strings and action.help != argparse.SUPPRESS:  # says its default
                assert "default" in action.help or "required" in action.help, \
                    (ap.prog, action.option_strings, action.help)
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:  # each subcommand's one-line help
                    assert choice.help and choice.help.strip() != choice.dest, (ap.prog, choice.dest)
    with pytest.raises(SystemExit) as exc:
        _cli(module).main(["--help"])
    assert exc.value.code == 0
    assert prog in capsys.readouterr().out


def _required_argv(ap: argparse.ArgumentParser) -> list:
    """Values for the parser's required arguments (the first subcommand's too), so that an
    unrecognized flag is the only error left."""
    argv = []
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            name, sub = next(iter(action.choices.items()))
            argv += [name, *_required_argv(sub)]
        elif action.required and action.option_strings:
            argv += [action.option_strings[0], "x"]
        elif action.required:  # a positional
            argv.append("x")
    return argv


@pytest.mark.parametrize("module", list(COMMANDS))
def test_a_prefix_of_a_long_flag_is_refused(module, capsys):
    """argparse's prefix matching made `--load` silently mean `--load-weights` once: refused."""
    for ap in _all_parsers(module):
        flags = {o for a in ap._actions for o in a.option_strings}
        longs = sorted(o for o in flags if o.startswith("--") and len(o) > 6 and o[:-2] not in flags)
        prefixes = [longs[0][:-2]] if longs else []
        prefixes.append("--hel")  # every parser has --help
        for prefix in prefixes:
            with pytest.raises(SystemExit) as exc:
                ap.parse_args([*_required_argv(ap), prefix, "x"])
            err = capsys.readouterr().err
            assert exc.value.code == 2 and "unrecognized arguments" in err and prefix in err, \
                (ap.prog, prefix, err)


def test_the_installed_console_script_runs():
    script = Path(sys.executable).parent / "aoe-checkpoints"
    assert script.is_file(), f"{script} is missing: reinstall the package (pip install -e .)"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "aoe-checkpoints" in proc.stdout and "verify" in proc.stdout
