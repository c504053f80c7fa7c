from aoe_megatron.runtime.exit import exit_now
from aoe_megatron.cli.train import main  # an entry point: the command's module

exit_now(main())
