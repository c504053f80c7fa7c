"""Training checkpoints <-> Hugging Face folders (AoE with remote code; stock MoE as Mixtral): the
two directions' entry points in one place.

- ``export_to_hf`` (``to_hf.py``): a checkpoint at any EP size to a folder, streamed a layer slice
  at a time, with the preprocessing tokenizer;
- ``import_from_hf`` (``from_hf.py``): an exported AoE or a Mixtral folder to a weights-only
  checkpoint (``--load-weights``);
- both read one table (``mapping.links``), so the round trip is exact by construction and tested,
  and both publish their output whole or not at all (``checkpoint_io.staged_output``).
"""

from aoe_megatron.hf.checkpoint_io import ConversionError
from aoe_megatron.hf.from_hf import import_from_hf
from aoe_megatron.hf.to_hf import data_manifest, export_to_hf, export_tokenizer

__all__ = ["ConversionError", "data_manifest", "export_to_hf", "export_tokenizer", "import_from_hf"]
