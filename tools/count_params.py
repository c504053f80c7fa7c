#!/usr/bin/env python
"""Total and active parameters of a model preset, without allocating it.

    python tools/count_params.py 732m            # MoE and AoE side by side
    python tools/count_params.py 4b --arch aoe --json
    python tools/count_params.py run/presets/732m.yaml --d-low 128

Same as `python -m aoe_megatron.models.params` and the `aoe-count-params` command.
"""

from aoe_megatron.models.params import main

if __name__ == "__main__":
    raise SystemExit(main())
