"""Hugging Face format, both ways: training checkpoints to a ``trust_remote_code`` folder and back
(``convert``, streaming through ``checkpoint_io``), and the self-contained model, config and
tokenizer files copied into every exported folder (``modeling_aoe``, ``configuration_aoe``,
``tokenization_aoe``: they import nothing from this package)."""
