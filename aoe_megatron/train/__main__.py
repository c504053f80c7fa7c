from aoe_megatron.train.loop import main

raise SystemExit(main())
