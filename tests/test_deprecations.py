"""Deprecations (issue #37, item 7): the code's aliases are exactly runtime/deprecations.py's, each
names the release that removes it, CHANGELOG.md lists each, and this file fails once the package
reaches a removal release while the alias is still there."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path

import aoe_megatron
from aoe_megatron.moe.config import LEGACY_KEYS
from aoe_megatron.runtime.deprecations import DEPRECATIONS, NEXT, deprecation, overdue, renamed

ROOT = Path(__file__).resolve().parents[1]


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_the_code_carries_exactly_the_registered_aliases():
    from aoe_megatron.train import flags

    modules = {f"aoe_megatron.{p.stem}" for p in (ROOT / "aoe_megatron").glob("*.py")
               if _docstring(p).startswith("Deprecated import path")}
    assert modules == set(renamed("module"))  # each checked in tests/test_layout.py
    scripts = {f"tools/{p.name}" for p in (ROOT / "tools").glob("*.py")
               if _docstring(p).startswith("Deprecated: use")}
    assert scripts == set(renamed("script"))
    for script, command in renamed("script").items():
        text = (ROOT / script).read_text()
        assert f"use `{command}`" in text and f"deprecation('{script}')" in text, script
    assert set(renamed("flag")) <= set(flags.parser()._option_string_actions)  # tests/test_flags.py
    assert renamed("key") == LEGACY_KEYS


def test_each_use_names_the_release_that_removes_it(capsys):
    from aoe_megatron.train import flags

    for d in DEPRECATIONS:
        assert d.removed_in or d.why, d  # a kept alias says why it is kept
        if d.removed_in:
            assert f"it goes in {d.removed_in}" in d.notice()
    name = "aoe_megatron.ops"
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(name)
    assert deprecation(name).notice() in [str(w.message) for w in caught]
    flags.parse_train_args(["--preset", "tiny", "--train-steps", "2"])
    assert f"note: {deprecation('--train-steps').notice()}" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "tools/count_params.py", "tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"it goes in {NEXT}" in done.stderr, done.stderr[-2000:]


def test_no_alias_outlives_its_release():
    """Fails once pyproject's version reaches an entry's removal release: remove the alias (and
    its entry), then this passes again."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert version == aoe_megatron.__version__
    assert not overdue(version), [d.old for d in overdue(version)]
    # the check bites: at the removal release every entry with one is overdue
    assert overdue(NEXT) == [d for d in DEPRECATIONS if d.removed_in]
    assert overdue("0.1.9") == [] and overdue("1.0") == overdue(NEXT)


def test_the_changelog_lists_each_deprecation_with_its_release():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and "keepachangelog.com" in text
    released = re.search(r"^## \[(\d+\.\d+\.\d+)\]", text, re.M)
    assert released and released[1] == aoe_megatron.__version__
    section = "\n".join(part.split("\n## ", 1)[0].split("\n### ", 1)[0]  # every release's
                        for part in text.split("### Deprecated")[1:])
    for d in DEPRECATIONS:
        line = next((x for x in section.splitlines() if f"`{d.old}`" in x), None)
        assert line is not None, f"CHANGELOG.md's Deprecated section does not name {d.old}"
        assert (f"removed in {d.removed_in}" if d.removed_in else "kept") in line, line


def test_the_declared_license_is_in_the_repository():
    """pyproject.toml and the README declare Apache-2.0; its text is LICENSE (setuptools puts
    LICENSE* into the wheel's metadata by default)."""
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
