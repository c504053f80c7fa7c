"""The trainer's exceptions, imported by the modules that raise them (checkpoint, faults,
datacheck) and by the loop that reports them."""


class TrainingHalted(RuntimeError):
    """The run stops on purpose and must not simply be restarted: ``main`` prints the message,
    writes ``halted.json`` in the run directory and exits non-zero."""

