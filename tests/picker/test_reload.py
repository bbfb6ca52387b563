"""Config reloads leak nothing: state a new config no longer uses is released, with the
callbacks it registered, and memory returns to where it was.

Each reload rebuilds every plugin. Before shared state had lifetimes, a reload that changed the
prefix scorer's parameters kept the old index alive and added another removal callback to the
endpoint store, every time.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from typing import Any

import yaml

from kv_picker.app import PickerApp
from kv_picker.config import load_config
from kv_picker.plugins import builtin_registry
from kv_picker.request import LLMRequest, Prompt

REGISTRY = builtin_registry(include_entry_points=False)
ENDPOINTS = [{"address": f"127.0.0.1:{9000 + i}"} for i in range(4)]


def write(path: Path, block_size_chars: int, ttl: str = "2s") -> None:
    document: dict[str, Any] = {
        "endpoints": ENDPOINTS,
        "plugins": [
            {"type": "prefix-cache-scorer", "parameters": {"blockSizeChars": block_size_chars}},
            {"type": "active-request-scorer"},
            {"type": "max-score-picker"},
        ],
    }
    path.write_text(yaml.safe_dump(document))


def ready(app: PickerApp) -> None:
    for endpoint in app.store.all():
        app.store.update_metrics(endpoint.id, waiting=0, running=0, kv_usage=0)


def route_some(app: PickerApp, tag: int, count: int = 40) -> None:
    """Fill the running config's prefix index with ``count`` distinct 8 KB prompts."""
    for i in range(count):
        text = f"tenant {tag}-{i} " + "context words " * 600
        request = LLMRequest(
            f"r{tag}-{i}", "m", "m", "/v1/completions", Prompt("completions", text)
        )
        app.director.route(request).finish()


def footprint(app: PickerApp) -> tuple[int, int, int]:
    """(store callbacks, shared resources, traced bytes) after a full collection."""
    gc.collect()
    return app.store.num_subscribers(), len(app.ctx.shared), tracemalloc.get_traced_memory()[0]


def test_200_alternating_reloads_return_to_the_first_reloads_footprint(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    write(path, 64)
    app = PickerApp(load_config(path, REGISTRY), REGISTRY, config_path=path)
    ready(app)
    tracemalloc.start()
    try:
        footprints = []
        for reload in range(1, 201):
            write(path, 32 if reload % 2 else 64)
            assert app.reload()
            ready(app)
            route_some(app, reload)
            if reload in (1, 199):
                footprints.append(footprint(app))
    finally:
        tracemalloc.stop()
    (callbacks_1, shared_1, bytes_1), (callbacks_199, shared_199, bytes_199) = footprints
    assert (callbacks_199, shared_199) == (callbacks_1, shared_1)
    # Each index holds about 40 x 128 blocks; 200 of them kept alive would be megabytes.
    assert bytes_199 - bytes_1 < 256 * 1024, (bytes_1, bytes_199)


def test_reloads_with_ever_new_parameters_keep_one_index_and_one_callback(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    write(path, 64)
    app = PickerApp(load_config(path, REGISTRY), REGISTRY, config_path=path)
    baseline = app.store.num_subscribers()
    for block_size_chars in range(16, 216):
        write(path, block_size_chars)
        assert app.reload()
        assert app.store.num_subscribers() == baseline
        assert len(app.ctx.shared) == 1


def test_an_unchanged_index_survives_a_reload_and_a_rejected_reload_releases_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "picker.yaml"
    write(path, 64)
    app = PickerApp(load_config(path, REGISTRY), REGISTRY, config_path=path)
    ready(app)
    route_some(app, 0, count=3)
    index = app.director.scheduler.plugins["prefix-cache-scorer"].index
    assert len(index) > 0
    write(path, 64)
    assert app.reload()
    assert app.director.scheduler.plugins["prefix-cache-scorer"].index is index  # kept
    path.write_text("plugins: [{type: prefix-cache-scorer, parameters: {blockSizeChars: 0}}]\n")
    assert not app.reload()
    assert app.director.scheduler.plugins["prefix-cache-scorer"].index is index
    assert len(app.ctx.shared) == 1 and len(index) > 0
