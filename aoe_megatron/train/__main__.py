from aoe_megatron.runtime.exit import exit_now
from aoe_megatron.train.command import main

exit_now(main())
