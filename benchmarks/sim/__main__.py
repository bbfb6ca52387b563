"""``python -m kv_picker_bench.sim``: run one simulated vLLM endpoint."""

from kv_picker_bench.sim.cli import main

raise SystemExit(main())
