"""Scraping in a child process, so the event loop that answers Envoy only applies results.

Scraping every endpoint's ``/metrics`` every 100 ms is an HTTP request and a text parse per
endpoint: with 16 endpoints, 160 of each per second. On the event loop that answers ext_proc
streams, that work costs more than the routing itself at moderate load and delays requests that
arrive during a parse. Here a child process does the fetching and parsing; the picker receives
one short line per scrape and applies it.

```
picker (event loop)                          child: python -m kv_picker.sources.scrape_process
  settings + endpoints (JSON line) ──stdin──>  scrape each endpoint, staggered over the interval
  apply to the store and gauges   <─stdout──  [token, waiting, running, kv, block, blocks, lora]
                                               [token, "error"]  |  ["round"]
```

- The child is sent the endpoint set again whenever it changes (discovery, reload), and new
  endpoints are scraped at once. Each endpoint is named by a token the picker assigned, so a
  result for an endpoint that has left (or been replaced at the same address) is dropped.
- The child exits when its stdin closes: it never outlives the picker.
- If the child dies, the picker starts another after a second. Meanwhile the scrapes go stale
  and the scorers treat the endpoints as fully loaded (``metrics.stalenessThreshold``).

``metrics.scraper: inline`` keeps the scraping on the event loop (one process, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from kv_picker.endpoint import Endpoint
from kv_picker.sources.scraper import (
    EndpointSignals,
    MetricsParseError,
    MetricsScraper,
    fetch_signals,
)
from kv_picker.state.endpoints import LoraState

log = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0


class ProcessScraper(MetricsScraper):
    """:class:`MetricsScraper` whose fetching and parsing run in a child process.

    Same constructor, attributes and results as the inline scraper; :meth:`run` manages the
    child (start, feed, restart) instead of scraping on the loop.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.child_pid: int | None = None
        self.children_started = 0
        # Tokens name endpoints to the child: one per Endpoint object, never reused.
        self._tokens: dict[int, tuple[Endpoint, int]] = {}
        self._next_token = 0
        self._send: Callable[[], None] | None = None  # the running child's feed

    def configure(self, interval_s: float, timeout_s: float, path: str) -> None:
        super().configure(interval_s, timeout_s, path)
        if self._send is not None:
            self._send()

    async def run(self) -> None:
        while True:
            try:
                await self._run_child()
            except OSError as exc:  # could not start it at all
                log.error("metrics scrape process failed to start: %s", exc)
            log.warning("metrics scrape process exited; starting another in %.0f s",
                        RESTART_DELAY_S)  # fmt: skip
            await asyncio.sleep(RESTART_DELAY_S)

    async def _run_child(self) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kv_picker.sources.scrape_process",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self.child_pid = process.pid
        self.children_started += 1
        assert process.stdin is not None and process.stdout is not None
        stdin, stdout = process.stdin, process.stdout
        tokens: dict[int, Endpoint] = {}
        sent: list[Any] = []

        def send(*_: object) -> None:
            endpoints = self.store.all()
            tokens.clear()
            listing = []
            for endpoint in endpoints:
                token = self._token(endpoint)
                tokens[token] = endpoint
                listing.append([token, endpoint.address])
            message = [self.interval_s, self.timeout_s, self.path, listing]
            if message != sent:
                sent[:] = message
                stdin.write(json.dumps(message).encode() + b"\n")

        subscription = self.store.on_change(send)
        self._send = send
        try:
            send()
            while line := await stdout.readline():
                self._apply(line, tokens)
        finally:
            subscription.cancel()
            self._send = None
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await process.wait()
            self.child_pid = None

    def _token(self, endpoint: Endpoint) -> int:
        known = self._tokens
        entry = known.get(id(endpoint))
        if entry is not None and entry[0] is endpoint:
            return entry[1]
        self._next_token += 1
        known[id(endpoint)] = (endpoint, self._next_token)
        if len(known) > 4 * len(self.store) + 64:  # forget endpoints that left
            live = {id(e) for e in self.store.all()}
            for key in [k for k in known if k not in live]:
                del known[key]
        return self._next_token

    def _apply(self, line: bytes, tokens: dict[int, Endpoint]) -> None:
        try:
            message = json.loads(line)
            if message[0] == "round":
                self._round_done(len(self.store))
                return
            endpoint = tokens.get(message[0])
            if endpoint is None:
                return
            if len(message) == 2:
                self.result(endpoint, None, str(message[1]))
            else:
                self.result(endpoint, decode_signals(message))
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            log.error("unreadable line from the metrics scrape process: %s", exc)


def decode_signals(message: Sequence[Any]) -> EndpointSignals:
    """[name, waiting, running, KV usage, block size, GPU blocks, LoRA, first tokens | None]
    -> signals."""
    _, waiting, running, kv_usage, block_size, num_blocks, lora, first_tokens = message
    return EndpointSignals(
        waiting=float(waiting),
        running=float(running),
        kv_usage=float(kv_usage),
        block_size_tokens=int(block_size),
        num_gpu_blocks=int(num_blocks),
        lora=None
        if lora is None
        else LoraState(frozenset(lora[0]), frozenset(lora[1]), int(lora[2])),
        first_tokens=None if first_tokens is None else float(first_tokens),
    )


def encode_signals(name: object, signals: EndpointSignals) -> list[Any]:
    """Signals as a list that JSON or msgpack carries, led by ``name`` (see decode_signals)."""
    lora = signals.lora
    return [
        name,
        signals.waiting,
        signals.running,
        signals.kv_usage,
        signals.block_size_tokens,
        signals.num_gpu_blocks,
        None if lora is None else [sorted(lora.running), sorted(lora.waiting), lora.max_lora],
        signals.first_tokens,
    ]


# -- the child ------------------------------------------------------------------------------


class _Child:
    def __init__(self) -> None:
        self.interval_s = 0.1
        self.timeout_s = 1.0
        self.path = "/metrics"
        self.endpoints: dict[int, str] = {}
        self.changed = asyncio.Event()
        self.in_flight: dict[int, asyncio.Task[None]] = {}
        self.session: aiohttp.ClientSession | None = None

    def emit(self, message: list[Any]) -> None:
        sys.stdout.buffer.write(json.dumps(message).encode() + b"\n")
        sys.stdout.buffer.flush()

    def start(self, token: int) -> None:
        previous = self.in_flight.get(token)
        if previous is None or previous.done():
            self.in_flight[token] = asyncio.create_task(self.scrape(token))

    async def scrape(self, token: int) -> None:
        address = self.endpoints.get(token)
        if address is None or self.session is None:
            return
        try:
            signals = await asyncio.wait_for(
                fetch_signals(self.session, address, self.path), self.timeout_s
            )
        except (aiohttp.ClientError, TimeoutError, MetricsParseError, UnicodeDecodeError) as exc:
            self.emit([token, str(exc) or type(exc).__name__])
            return
        self.emit(encode_signals(token, signals))

    async def read_commands(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            interval_s, timeout_s, path, listing = json.loads(line)
            self.interval_s, self.timeout_s, self.path = float(interval_s), float(timeout_s), path
            wanted = {int(token): str(address) for token, address in listing}
            for token in [t for t in self.in_flight if t not in wanted]:
                self.in_flight.pop(token).cancel()
            new = [t for t in wanted if t not in self.endpoints]
            self.endpoints = wanted
            for token in new:
                self.start(token)
            self.changed.set()

    async def scrape_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            tokens = list(self.endpoints)
            if not tokens:
                self.changed.clear()
                await self.changed.wait()
                continue
            slot_s = self.interval_s / len(tokens)
            for token in tokens:
                started = loop.time()
                if token in self.endpoints:
                    self.start(token)
                await asyncio.sleep(max(0.0, slot_s - (loop.time() - started)))
            self.emit(["round"])

    async def main(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.session = session
            scraping = asyncio.create_task(self.scrape_forever())
            try:
                await self.read_commands()  # returns when the picker closes our stdin
            finally:
                scraping.cancel()
                for task in self.in_flight.values():
                    task.cancel()
                await asyncio.gather(scraping, *self.in_flight.values(), return_exceptions=True)


def main() -> int:
    # The picker's signals are for the picker: a SIGTERM to its process group must not end the
    # scraping before the picker drains. The child ends when the picker closes its stdin (or
    # dies, which closes it too).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        asyncio.run(_Child().main())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
