"""Training checkpoints: the folder's layout, names and pointers (``layout``), the manifest every
checkpoint carries, written at save and verified by every reader (``integrity``), a checkpoint's
model for the readers that want only the weights (``model``), and what can be wrong with one
(``errors``). The trainer's save and resume (``train/checkpoint*.py``) and every reader (the
Hugging Face export, the study's tools, ``aoe-checkpoints``) go through it."""
