"""The command line: one module per command, each with ``parser()`` and ``main(argv=None)``,
installed as the ``aoe-*`` console scripts (pyproject.toml's ``[project.scripts]``) and runnable
as ``python -m aoe_megatron.cli.<module>``.

These modules only parse arguments and report; the library code they call lives in the other
rooms (``aoe_megatron.data``, ``aoe_megatron.hf``, ``aoe_megatron.evaluation``,
``aoe_megatron.bench``, ``aoe_megatron.study``, ...). The train command (``train``) is also
``python -m aoe_megatron.train``, the form torchrun launches.
"""
