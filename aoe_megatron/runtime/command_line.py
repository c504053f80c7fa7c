"""What every console script's parser shares (``CommandParser``): ``--version``, which prints
aoe-megatron's version with the installed megatron-core's and torch's, read from their package
metadata. Nothing here imports torch or megatron-core: ``--help`` and ``--version`` answer at
once."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def version_text(prog: str) -> str:
    """``aoe-train 0.1.0 (megatron-core 0.16.1, torch 2.11.0, Python 3.11.9)``."""
    ours = getattr(sys.modules.get("aoe_megatron"), "__version__", None) or _installed("aoe-megatron")
    python = ".".join(str(n) for n in sys.version_info[:3])
    return (f"{prog} {ours} (megatron-core {_installed('megatron-core')}, torch "
            f"{_installed('torch')}, Python {python})")


class _Version(argparse._VersionAction):
    """``--version``: the versions, looked up only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the versions of aoe-megatron, megatron-core and torch, and exit"):
        super().__init__(option_strings, dest=dest, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text(parser.prog.split()[0]), flush=True)
        parser.exit()


def add_version(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser`` the ``--version`` flag."""
    parser.add_argument("--version", action=_Version)
    return parser


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with ``--version`` after ``--help`` (its subcommands' parsers too)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.add_help:
            add_version(self)
