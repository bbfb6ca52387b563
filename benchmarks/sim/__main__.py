"""``python -m benchmarks.sim``: run one simulated vLLM endpoint."""

from benchmarks.sim.server import main

raise SystemExit(main())
