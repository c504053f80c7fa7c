"""The package's rooms (issue #21): each imports only the rooms below it, no module imports itself
back through a circle, and the import paths of the flat layout still work (until 0.2.0)."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

from aoe_megatron.runtime.deprecations import renamed

PACKAGE = Path(__file__).resolve().parents[1] / "aoe_megatron"

#: room -> the rooms its modules may import (the package's own ``__init__`` is open to all).
ALLOWED = {
    "patches": set(),
    "runtime": {"patches"},
    "checkpoint": {"models", "patches", "runtime"},
    "moe": {"runtime"},
    "models": {"moe", "runtime"},
    "data": {"runtime"},
    "train": {"checkpoint", "data", "models", "moe", "patches", "runtime"},
    "hf": {"checkpoint", "data", "models", "moe", "runtime"},
    "evaluation": {"data", "hf", "models", "runtime"},
    "bench": {"checkpoint", "models", "moe", "runtime", "train"},
    "study": {"bench", "checkpoint", "data", "evaluation", "hf", "models", "moe", "runtime", "train"},
    "cli": {"bench", "checkpoint", "data", "evaluation", "hf", "models", "moe", "runtime", "study",
            "train"},
}
#: Modules that import nothing of the package and are open to every room: which megatron-core
#: releases are supported, and sha256 of files as they are written, both used by the patches
#: below everything else; the deprecated names and the release that removes them.
LEAVES = {"aoe_megatron.runtime.versions", "aoe_megatron.runtime.hashing",
          "aoe_megatron.runtime.deprecations"}
#: The flat layout's module names kept as thin aliases (until 0.2.0), and where they went.
MOVED = {"aoe_megatron.config": "aoe_megatron.moe.config",
         "aoe_megatron.ops": "aoe_megatron.moe.ops",
         "aoe_megatron.model": "aoe_megatron.models.gpt",
         "aoe_megatron.distributed": "aoe_megatron.runtime.distributed"}


def _modules() -> dict:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(modules: dict) -> dict:
    """module -> the package's modules it imports anywhere in its body (functions included)."""
    edges = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_room_imports_only_the_rooms_below_it():
    modules = _modules()
    rooms = {_room(m) for m in modules} - {""}
    top_level = {m for m in modules if m.count(".") == 1 and (PACKAGE / f"{_room(m)}.py").is_file()}
    assert rooms - set(ALLOWED) == {_room(m) for m in top_level}, "a room without a rule"
    edges = _imports(modules)
    # A room's __main__ is a command's entry point (``python -m aoe_megatron.train``): above
    # every room, as cli/ is.
    wrong = [f"{a} imports {b}" for a, targets in edges.items() for b in targets
             if _room(a) in ALLOWED and b not in LEAVES and not a.endswith(".__main__")
             and _room(b) not in ALLOWED[_room(a)] | {_room(a), ""}]
    assert not wrong, wrong
    assert not any(edges.get(leaf) for leaf in LEAVES), {leaf: edges.get(leaf) for leaf in LEAVES}


#: What only the checkpoint room spells (``checkpoint/layout.py``): the pointer files' names exactly,
#: and the state and manifest files' names anywhere in a string (a corpus manifest,
#: ``PREFIX.manifest.json``, is another file: a name after a dot is not matched).
CHECKPOINT_NAMES = re.compile(r"^(latest|last_verified)$|(?<![\w.])(state|manifest)\.json\b")


def _string_literals(path: Path) -> list:
    """(line, text) of each string constant of ``path`` that is not documentation (a docstring, or
    any other string standing alone as a statement); f-strings' literal parts included."""
    tree = ast.parse(path.read_text())
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose]


def test_only_the_checkpoint_room_spells_the_checkpoint_files_names():
    """``latest``, ``last_verified``, ``state.json`` and ``manifest.json`` as code uses them (not
    as prose): every reader and writer of checkpoints, in the package and in tools/, goes through
    ``checkpoint/layout.py``."""
    room = PACKAGE / "checkpoint"
    files = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "tools").glob("*.py")]
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}" for path in files
             if room not in path.parents for line, text in _string_literals(path)
             if CHECKPOINT_NAMES.search(text)]
    assert not found, found
    spelled = {text for path in room.glob("*.py") for _, text in _string_literals(path)}
    assert {"latest", "last_verified", "state.json", "manifest.json"} <= spelled


def test_no_two_modules_define_a_public_class_of_one_name():
    """A class name says which class it is: the layer's AoEConfig is not the Hugging Face one
    (AoEHFConfig), nor a checkpoint error another room's."""
    where = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(str(path.relative_to(PACKAGE)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


def test_no_import_circle():
    edges = _imports(_modules())
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(_modules()):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


#: The package's own imports still inside functions, each with its ``# deferred:`` reason: a
#: console script's ``--help`` answers before torch loads, megatron-core loads when a model is
#: built, transformers only for an export, ``runtime.spawn``'s children start without torch,
#: ``compat`` runs before ``import aoe_megatron`` loads the patches. A ceiling: the count may only
#: go down (lower it when one moves to the top).
DEFERRED_OWN_IMPORTS = 41


def _own_imports_in_functions(path: Path) -> list:
    """(line, first line of the statement) of each import of the package's own modules inside a
    function of ``path`` (``aoe_megatron...``, or relative)."""
    source = path.read_text()
    lines = source.splitlines()
    found = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["aoe_megatron" if node.level else node.module or ""]
            else:
                continue
            if any(n == "aoe_megatron" or n.startswith("aoe_megatron.") for n in names):
                found.add((node.lineno, lines[node.lineno - 1].strip()))
    return sorted(found)


def test_own_imports_inside_functions_say_why_they_are_deferred():
    """A module's top shows what it uses: an import of the package's own modules stays inside a
    function only where the top would be wrong, and its first line says why (``# deferred:``).
    Left out: the patches (their arming order) and the flat layout's aliases."""
    modules = {name: path for name, path in _modules().items()
               if not name.startswith("aoe_megatron.patches") and name not in MOVED}
    found = [(path, line, text) for _, path in sorted(modules.items())
             for line, text in _own_imports_in_functions(path)]
    unexplained = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
                   for path, line, text in found if "# deferred:" not in text]
    assert not unexplained, unexplained
    assert len(found) <= DEFERRED_OWN_IMPORTS, (
        f"{len(found)} deferred imports, more than {DEFERRED_OWN_IMPORTS}: move the new one to "
        f"the module's top")


def test_the_moved_modules_are_the_registered_ones():
    assert MOVED == renamed("module")  # runtime/deprecations.py: each names its release


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_the_flat_layouts_import_paths_still_work(old, new):
    """``from aoe_megatron.config import AoEConfig`` and the like: the same module, with a
    DeprecationWarning naming the new path."""
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
               for w in caught), [str(w.message) for w in caught]


def test_the_old_names_users_import_resolve():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from aoe_megatron.config import AoEConfig
        from aoe_megatron.distributed import init_megatron
        from aoe_megatron.model import build_gpt_model, load_preset
        from aoe_megatron.moe import config, ops
        from aoe_megatron.ops import d_wide_for_parity  # noqa: F401
    from aoe_megatron.models import gpt
    from aoe_megatron.runtime import distributed

    assert AoEConfig is config.AoEConfig and load_preset is gpt.load_preset
    assert build_gpt_model is gpt.build_gpt_model and init_megatron is distributed.init_megatron
    assert ops.__name__ == "aoe_megatron.moe.ops"


def test_the_package_itself_imports_none_of_the_deprecated_paths():
    """Inside the package every import uses the new rooms (a deprecated alias would warn)."""
    edges = _imports(_modules())
    users = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                   if b in MOVED and a not in MOVED)
    assert not users, users


def test_the_install_names_every_package_folder():
    """pyproject.toml lists the packages (run/ installs as ``aoe_megatron._run``, mapped by
    package-dir; patches are the package's own ``aoe_megatron.patches``): a new room must be
    added there."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(PACKAGE.parent).parts)
               for p in PACKAGE.rglob("__init__.py")}
    assert set(config["packages"]) == folders | {"aoe_megatron._run"}
    assert config["package-dir"] == {"aoe_megatron._run": "run"}
    assert not (PACKAGE.parent / "patches").exists()


def test_the_patches_are_a_subpackage_that_never_imports_the_rest_of_the_package():
    """``aoe_megatron.patches`` imports upstream engines and the ``LEAVES`` only
    (``runtime.versions``, ``runtime.hashing``): no room of ours (models, train, ...) comes in
    through a patch."""
    import aoe_megatron
    from aoe_megatron import patches

    assert aoe_megatron.apply_patches is patches.apply_patches
    assert "patches" not in sys.modules  # no top-level module of that name
    edges = _imports(_modules())
    ours = sorted(f"{a} -> {b}" for a, targets in edges.items() if a.startswith("aoe_megatron.patches")
                  for b in targets if b.startswith("aoe_megatron.")
                  and not b.startswith("aoe_megatron.patches") and b not in LEAVES)
    assert not ours, ours


def _test_module_imports(path: Path) -> list:
    """The test modules (``test_*``) that ``path`` imports, anywhere in its body: ``from
    tests.test_x import ...``, ``import tests.test_x``, ``from .test_x import ...``, ``from . import
    test_x``, ``from tests import test_x`` and the bare ``import test_x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 0 and base not in ("", "tests"):
                names = [base]
            else:  # relative, or ``from tests import ...``: the names may be modules
                names = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
                names.append(base)
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests":
                parts = parts[1:]
            if parts and parts[0].startswith("test_"):
                found.append(f"line {node.lineno}: {parts[0]}")
    return found


def test_no_test_file_imports_another_test_file():
    """What test files share lives in tests/helpers.py (functions, constants) or tests/conftest.py
    (fixtures): importing a test module runs its module-level code and collects its fixtures
    twice, and ties the two files' names together."""
    tests = Path(__file__).resolve().parent
    offenders = {p.name: found for p in sorted(tests.glob("test_*.py"))
                 if (found := _test_module_imports(p))}
    assert not offenders, offenders


def test_the_test_import_check_sees_every_form(tmp_path):
    forms = ["from tests.test_train import COMMON", "import tests.test_train",
             "from .test_train import COMMON", "from . import test_train",
             "from tests import test_train", "import test_train",
             "def f():\n    from tests.test_train import COMMON"]
    for form in forms:
        (tmp_path / "test_x.py").write_text(form + "\n")
        assert _test_module_imports(tmp_path / "test_x.py"), form
    (tmp_path / "test_x.py").write_text("from tests.helpers import run_distributed\n"
                                        "from tests import helpers\nimport torch.testing\n")
    assert _test_module_imports(tmp_path / "test_x.py") == []
