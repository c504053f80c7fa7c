"""What can be wrong with a checkpoint, one class each under ``CheckpointError`` (a ValueError:
bad input, the command-line tools exit 2; the train command halts with exit 3 and
``halted.json``, as a restart would meet the same files)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names it and the ways on."""


class CheckpointNotFound(CheckpointError):
    """A path that is neither a checkpoint nor a checkpoint folder whose ``latest`` names one."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint that fails verification (every problem named), or whose manifest is
    unreadable."""


class CheckpointTooOld(CheckpointError):
    """A checkpoint of an older format than a resume reads (its weights still load:
    ``--load-weights``)."""


class CheckpointTooNew(CheckpointError):
    """A checkpoint the installed megatron-core cannot read (saved by a later release)."""
