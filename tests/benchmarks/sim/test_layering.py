"""The simulated endpoint's layers import downwards only: cli -> endpoint -> openai_api.

The HTTP layer reaches the engine through the ``Backend`` and ``Generation`` protocols, so it
never needs the endpoint module, not even for type annotations.
"""

from __future__ import annotations

import grimp
import pytest

PACKAGE = "kv_picker_bench.sim"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("kv_picker_bench", cache_dir=None)


@pytest.mark.parametrize(
    ("importer", "imported"),
    [("openai_api", "endpoint"), ("openai_api", "cli"), ("endpoint", "cli")],
)
def test_no_upward_import(graph: grimp.ImportGraph, importer: str, imported: str) -> None:
    chain = graph.find_shortest_chain(
        importer=f"{PACKAGE}.{importer}", imported=f"{PACKAGE}.{imported}"
    )
    assert chain is None, " -> ".join(chain or ())


def test_downward_imports_are_seen(graph: grimp.ImportGraph) -> None:
    # The same query finds the imports that do exist: the test above is not vacuous.
    for importer, imported in (("cli", "endpoint"), ("endpoint", "openai_api")):
        assert graph.find_shortest_chain(
            importer=f"{PACKAGE}.{importer}", imported=f"{PACKAGE}.{imported}"
        )
