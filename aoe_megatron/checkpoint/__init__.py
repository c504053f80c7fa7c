"""Training checkpoints: the folder's layout, names and pointers (``layout``), the manifest every
checkpoint carries, written at save and verified by every reader (``integrity``), a checkpoint's
model for the readers that want only the weights (``model``), the save (``save``), the resume
(``resume``) and the optimizer state each rank writes and reads (``optim_state``), and what can be
wrong with one (``errors``). The trainer (which says what a resume must match:
``train/resume_checks.py``) and every reader (the Hugging Face export, the study's tools,
``aoe-checkpoints``) go through it."""
