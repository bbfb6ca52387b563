"""KV events of the simulated endpoint, published the way vLLM publishes them.

The publisher is the prefix cache's listener: it hears every block that becomes cached, every
eviction and every reset, groups what happens in one engine step into one batch, and sends it
on a ZMQ PUB socket in vLLM's wire format (``vllm/distributed/kv_events.py``)::

    frames:  [topic, seq (8-byte big-endian, from 0 per process), msgpack(batch)]
    batch:   [ts, events, data_parallel_rank=0]
    events:  "array" encoding (vLLM before PR #42892): tagged positional arrays
               ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
                kv_cache_spec_sliding_window]
               ["BlockRemoved", block_hashes, medium, group_idx]     ["AllBlocksCleared"]
             "map" encoding (newer vLLM): {"type": "BlockStored", ...} with the same names;
               fields equal to their default (extra_keys, group_idx, kv_cache_spec_*) omitted
    hashes:  uint64 (vLLM's default int form: the low 64 bits of the block digest)

``extra_keys`` carries, per stored block, the tuple vLLM folded into its hash:
``(lora_name?, cache_salt if block 0?)`` or nil, so a subscriber can tell salted chains apart.

A ROUTER replay socket (when a port is given) answers ``[client, b"", start_seq]`` with every
buffered batch from ``start_seq`` as ``[client, b"", topic, seq, payload]`` (vLLM ≥ 0.26 adds
the topic frame), then ``[client, b"", b"", END_SEQ, b""]``. The last ``buffer_steps``
batches are kept, as vLLM's ``buffer_steps``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

from kv_picker_bench.sim.cache import CacheEventListener, StoredBlock

logger = logging.getLogger(__name__)

ENCODINGS: Final = ("array", "map")
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU: Final = "GPU"
FULL_ATTENTION: Final = "full_attention"


def default_topic(address: str, model: str) -> str:
    """The llm-d topic convention ``kv@<endpoint>@<model>``."""
    return f"kv@{address}@{model}"


def encode_stored(
    encoding: str,
    block_hashes: Sequence[int],
    parent_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None,
    extra_keys: list[Any] | None,
) -> Any:
    """One ``BlockStored`` event as vLLM's msgspec encoder lays it out."""
    if encoding == "array":
        return [
            "BlockStored",
            list(block_hashes),
            parent_hash,
            list(token_ids),
            block_size,
            None,  # lora_id: deprecated, the name identifies the adapter
            MEDIUM_GPU,
            lora_name,
            extra_keys,
            0,
            FULL_ATTENTION,
            None,
        ]
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent_hash,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM_GPU,
        "lora_name": lora_name,
    }
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    event["group_idx"] = 0
    event["kv_cache_spec_kind"] = FULL_ATTENTION
    return event


def encode_removed(encoding: str, block_hashes: Sequence[int]) -> Any:
    if encoding == "array":
        return ["BlockRemoved", list(block_hashes), MEDIUM_GPU, 0]
    return {
        "type": "BlockRemoved",
        "block_hashes": list(block_hashes),
        "medium": MEDIUM_GPU,
        "group_idx": 0,
    }


def encode_cleared(encoding: str) -> Any:
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[Any], data_parallel_rank: int = 0) -> bytes:
    """msgpack of ``[ts, events, data_parallel_rank]`` (vLLM's array-like ``EventBatch``)."""
    payload: bytes = msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)
    return payload


class KVEventPublisher:
    """Publishes the cache's changes as vLLM KV events (a :class:`CacheEventListener`).

    Args:
        port: PUB port on ``host`` (0 picks a free one; read :attr:`port` after :meth:`start`).
        topic: first frame of every message (default: set by :meth:`set_topic`, else "").
        encoding: ``array`` or ``map`` (see the module docstring).
        block_size: tokens per block (the ``block_size`` field of ``BlockStored``).
        replay_port: ROUTER port for replays (None: no replay socket; 0: a free port).
        host: address to bind.
        buffer_steps: batches kept for replay.
        forward_to: another listener that also receives every notification.
    """

    def __init__(
        self,
        port: int = 0,
        *,
        topic: str = "",
        encoding: str = "array",
        block_size: int = 16,
        replay_port: int | None = None,
        host: str = "127.0.0.1",
        buffer_steps: int = 10_000,
        forward_to: CacheEventListener | None = None,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}; got {encoding!r}")
        self.host = host
        self.port = port
        self.replay_port = replay_port
        self.topic = topic.encode()
        self.encoding = encoding
        self.block_size = block_size
        self.forward_to = forward_to
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pending: list[Any] = []
        self._flush_scheduled = False
        self._seq = 0
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.batches_sent = 0

    @property
    def url(self) -> str:
        """The PUB socket's address, e.g. ``tcp://127.0.0.1:5557``."""
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_url(self) -> str | None:
        """The replay socket's address, when there is one."""
        return None if self.replay_port is None else f"tcp://{self.host}:{self.replay_port}"

    def set_topic(self, topic: str) -> None:
        self.topic = topic.encode()

    async def start(self) -> None:
        """Bind the sockets (in the running loop; replays are served by a task).

        Raises:
            zmq.ZMQError: an address cannot be bound.
        """
        context = self._context = zmq.asyncio.Context()
        # A plain (synchronous) PUB socket: sending never blocks, PUB drops at the HWM.
        pub: zmq.Socket[bytes] = zmq.Context.shadow(context.underlying).socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self.port = self._bind(pub, self.port)
            self._pub = pub
            if self.replay_port is not None:
                router = context.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                self.replay_port = self._bind(router, self.replay_port)
                self._router = router
                self._replay_task = asyncio.create_task(
                    self._serve_replays(router), name=f"kv-replay-{self.port}"
                )
        except BaseException:
            await self.stop()
            raise

    def _bind(self, sock: zmq.Socket[Any], port: int) -> int:
        if port == 0:
            return sock.bind_to_random_port(f"tcp://{self.host}")
        sock.bind(f"tcp://{self.host}:{port}")
        return port

    async def stop(self) -> None:
        """Close the sockets. Idempotent."""
        self.flush()
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._router, self._pub):
            if sock is not None:
                sock.close(0)
        self._router = None
        self._pub = None
        if self._context is not None:
            self._context.term()
            self._context = None

    # -- listener ---------------------------------------------------------------------------

    def on_stored(self, blocks: Sequence[StoredBlock]) -> None:
        self.on_stored_for_request(blocks, None, None)

    def on_stored_for_request(
        self, blocks: Sequence[StoredBlock], lora_name: str | None, cache_salt: str | None
    ) -> None:
        """Blocks of one request became cached (one ``BlockStored`` event)."""
        if self.forward_to is not None:
            self.forward_to.on_stored(blocks)
        if not blocks:
            return
        lora_keys: tuple[str, ...] = (lora_name,) if lora_name else ()
        rest_extra = list(lora_keys) or None
        starts_at_block_0 = blocks[0].parent_hash is None
        extra_keys = [
            ([*lora_keys, cache_salt] if cache_salt else rest_extra)
            if i == 0 and starts_at_block_0
            else rest_extra
            for i in range(len(blocks))
        ]
        self._add(
            encode_stored(
                self.encoding,
                [b.block_hash for b in blocks],
                blocks[0].parent_hash,
                [t for b in blocks for t in b.token_ids],
                self.block_size,
                lora_name,
                extra_keys,
            )
        )

    def on_removed(self, block_hashes: Sequence[int]) -> None:
        if self.forward_to is not None:
            self.forward_to.on_removed(block_hashes)
        if block_hashes:
            self._add(encode_removed(self.encoding, block_hashes))

    def on_cleared(self) -> None:
        if self.forward_to is not None:
            self.forward_to.on_cleared()
        self._add(encode_cleared(self.encoding))

    def _add(self, event: Any) -> None:
        self._pending.append(event)
        if not self._flush_scheduled:
            # Everything one engine step does (it runs without awaiting) goes in one batch.
            try:
                asyncio.get_running_loop().call_soon(self.flush)
                self._flush_scheduled = True
            except RuntimeError:
                self.flush()

    def flush(self) -> None:
        """Send the pending events as one batch (no-op when there are none)."""
        self._flush_scheduled = False
        if not self._pending:
            return
        payload = encode_batch(time.time(), self._pending)
        self._pending = []
        seq = self._seq
        self._seq = seq + 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        self.batches_sent += 1

    # -- replay -----------------------------------------------------------------------------

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # vLLM ignores anything but [client, b"", start_seq]
            client = frames[0]
            start_seq = int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            # vLLM's end marker carries an empty topic frame.
            await router.send_multipart([client, b"", b"", END_SEQ, b""])
