"""The precise KV index in Redis or Valkey, shared by several picker replicas.

Why a shared backend: scaled out, each replica may receive only some endpoints' events (in bind
mode the publishers' connections are spread over replicas), yet every replica must see every
endpoint's blocks. Redis holds the one index they all read and write.

The scheduling path is synchronous, so the lookup cannot happen inside a scorer. Of the two
ways around that, this backend takes the pre-fetch (the two steps of
:class:`~kv_picker.state.kv_index.KVIndex`): :meth:`RedisKVIndex.prefetch` is awaited by the
precise scorer's ``prepare`` hook before the synchronous schedule (see
:class:`kv_picker.scheduling.framework.Prepare`) and costs one Redis round trip with the
request's keys; :meth:`RedisKVIndex.runs` then maps its answer (runs by address, Redis's
numbering being shared by replicas) to this replica's endpoint ids and merges the speculative
holders. A local mirror fed from Redis would make lookups free but put the whole index in
every replica's memory (what sharing is meant to avoid) and need a change feed to stay fresh;
the pre-fetch costs one round trip per request (sub-millisecond on a LAN) and nothing else.

Layout (``prefix`` = ``index.keyPrefix``; block keys are our 64-bit keys in hex)::

    {prefix}:slot           HASH endpoint address -> slot number, shared by every replica
    {prefix}:next-slot      counter handing out slots
    {prefix}:b:<key>        STRING bitmap of the slots holding the block (SETBIT/GETBIT order)
    {prefix}:e:<address>    SET of the endpoint's block keys (to clear it in one call)
    {prefix}:epoch          a token written once; when it changes or vanishes, Redis lost
                            its data and every writer resyncs what it knows

Lookup is one ``EVALSHA`` (``_LOOKUP``): walk the request's keys in order, ANDing the holders'
bitmaps, stop when no slot is left, return each slot's run. Consecutive blocks of a prefix are
almost always held by the same endpoints, so their bitmaps are the same bytes: the script
compares each block's bitmap with the previous one and only does bit work when they differ,
which makes a lookup one ``GET`` per block (a set-per-block layout costs a membership probe
per block and holder, about 50x more at 256 endpoints). Writes are batched: events apply to a
local :class:`BlockLedger` at once (it resolves engine hashes to keys and enforces the bounds,
exactly as in-process), and the resulting bit operations are pipelined to Redis every few
milliseconds.

Outage: a failed call marks the backend unavailable, counts a backend error, and for
``retry_s`` every lookup returns "no cache signal" at once (requests still route, on the other
scorers). Writes that could not be sent mark their endpoints dirty. When a ping succeeds again,
dirty endpoints are cleared in Redis and rewritten from the local ledger, so the shared index
converges back to what this replica knows, and the signal returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kv_picker.metrics import PickerMetrics
from kv_picker.state.block_events import BlockRemoved, BlockStored, EventKeys
from kv_picker.state.block_ledger import BlockLedger
from kv_picker.state.kv_index import Prefetched, SpeculativeHolders
from kv_picker.state.prefix_runs import leading_runs

log = logging.getLogger(__name__)

_LOOKUP = """
local first = redis.call('GET', KEYS[1])
local out = {}
if not first then return out end
local alive = {string.byte(first, 1, -1)}
local n = #alive
local function emit(bytes, run)
  for j = 1, n do
    local v = bytes[j]
    if v ~= 0 then
      for k = 0, 7 do
        if bit.band(v, bit.lshift(1, 7 - k)) ~= 0 then
          out[#out + 1] = (j - 1) * 8 + k
          out[#out + 1] = run
        end
      end
    end
  end
end
local prev = first
for i = 2, #KEYS do
  local raw = redis.call('GET', KEYS[i])
  if raw ~= prev then
    prev = raw
    local dropped = {}
    local changed = false
    local remaining = false
    for j = 1, n do
      local a = alive[j]
      local d = 0
      if a ~= 0 then
        local b = 0
        if raw then b = string.byte(raw, j) or 0 end
        local kept = bit.band(a, b)
        if kept ~= a then
          d = bit.band(a, 255 - b)
          alive[j] = kept
          changed = true
        end
        if kept ~= 0 then remaining = true end
      end
      dropped[j] = d
    end
    if changed then emit(dropped, i - 1) end
    if not remaining then return out end
  end
end
emit(alive, #KEYS)
return out
"""

# KEYS: block bitmaps; ARGV[1]: the endpoint's slot. Empty bitmaps are deleted.
_UNSET = """
local slot = tonumber(ARGV[1])
for _, key in ipairs(KEYS) do
  redis.call('SETBIT', key, slot, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end
return #KEYS
"""

# KEYS[1]: the endpoint's key set; ARGV: slot, bitmap key prefix.
_CLEAR = """
local slot = tonumber(ARGV[1])
local members = redis.call('SMEMBERS', KEYS[1])
for _, member in ipairs(members) do
  local key = ARGV[2] .. member
  redis.call('SETBIT', key, slot, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end
redis.call('DEL', KEYS[1])
return #members
"""

# KEYS: slot hash, counter; ARGV[1]: address. Returns the address's slot, assigning one.
_SLOT = """
local slot = redis.call('HGET', KEYS[1], ARGV[1])
if slot then return tonumber(slot) end
slot = redis.call('INCR', KEYS[2]) - 1
redis.call('HSET', KEYS[1], ARGV[1], slot)
return slot
"""

_FLUSH_INTERVAL_S = 0.005
_MAX_QUEUED_OPS = 200_000
_RESYNC_CHUNK = 5_000

_ADD = 0
_REMOVE = 1
_CLEAR_ALL = 2

# The walk over the speculative holders alone: Redis answers for the blocks events reported.
_NOTHING_HELD: dict[int, int] = {}


class RedisKVIndex:
    """Precise index kept in Redis (see the module docstring).

    Args:
        event_keys: key computation shared with the scorer (and where drops are reported).
        url: ``redis://`` (or ``valkey://``) URL.
        key_prefix: namespace of every key this index writes.
        address_of: endpoint id → address (the store's), None for unknown ids.
        default_capacity_blocks: per-endpoint bound when its KV capacity is not scraped.
        max_blocks: bound on (endpoint, block) entries this replica tracks.
        capacity_source: per endpoint id, its ``num_gpu_blocks`` (0 = unknown).
        timeout_s: budget of one lookup (and socket timeout).
        retry_s: how long to skip Redis after a failure before trying again.
        metrics: backend errors are counted here.
    """

    def __init__(
        self,
        event_keys: EventKeys,
        url: str,
        key_prefix: str,
        address_of: Callable[[int], str | None],
        default_capacity_blocks: int = 1_000_000,
        max_blocks: int = 10_000_000,
        capacity_source: Sequence[int] | None = None,
        timeout_s: float = 0.05,
        retry_s: float = 1.0,
        metrics: PickerMetrics | None = None,
    ) -> None:
        self.event_keys = event_keys
        self.url = url.replace("valkey://", "redis://", 1).replace("valkeys://", "rediss://", 1)
        self.prefix = key_prefix
        self._address_of = address_of
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.ledger = BlockLedger(
            default_capacity_blocks, max_blocks, capacity_source, self._evicted
        )
        self._errors = (
            {op: metrics.kv_index_backend_errors.labels(op) for op in ("lookup", "write")}
            if metrics is not None
            else None
        )
        self._client: Redis | None = None
        self._scripts: dict[str, Any] = {}
        # Slots are Redis's endpoint numbering, shared by all replicas; cached both ways.
        self._slots: dict[str, int] = {}
        self._slot_addresses: dict[int, str] = {}
        self._ops: list[tuple[int, str, list[int]]] = []
        self._flushing = False
        self._known_addresses: dict[int, str] = {}
        self._wake = asyncio.Event()
        self._dirty: set[str] = set()
        self._epoch: bytes | None = None
        self.available = False
        self._retry_at = 0.0
        self.lookups = 0
        self.failed_lookups = 0

    # -- lifecycle --------------------------------------------------------------------------

    def _connect(self) -> Redis:
        if self._client is None:
            self._client = Redis.from_url(
                self.url,
                socket_timeout=self.timeout_s * 4,
                socket_connect_timeout=self.timeout_s * 4,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
            for name, source in (
                ("lookup", _LOOKUP),
                ("unset", _UNSET),
                ("clear", _CLEAR),
                ("slot", _SLOT),
            ):
                self._scripts[name] = self._client.register_script(source)
        return self._client

    async def run(self) -> None:
        """Send queued writes and watch the connection until cancelled."""
        self._connect()
        await self._check()
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
            # cancellation that races its timeout, and the task would never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.retry_s):
                    await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(_FLUSH_INTERVAL_S)  # gather a few events into one pipeline
            if not self.available:
                self._drop_queue()
                if time.monotonic() >= self._retry_at:
                    await self._check()
                continue
            await self._flush()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _failed(self, operation: str, exc: BaseException) -> None:
        if self.available:
            log.warning(
                "KV index backend %s unavailable (%s: %s): no cache signal until it recovers",
                self.url,
                type(exc).__name__,
                exc,
            )
        self.available = False
        self._retry_at = time.monotonic() + self.retry_s
        if self._errors is not None:
            self._errors[operation].inc()

    async def _check(self) -> None:
        """Ping; on success make sure Redis still has our data (else resync), then resume."""
        client = self._connect()
        try:
            await client.ping()
            # Loaded up front: a lookup's EVALSHA must not cost a NOSCRIPT round trip.
            for source in (_LOOKUP, _UNSET, _CLEAR, _SLOT):
                await client.script_load(source)
            await self._check_epoch(client)
            for address in list(self._dirty):
                await self._resync(client, address)
                self._dirty.discard(address)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("write", exc)
            return
        if not self.available:
            log.info("KV index backend %s available", self.url)
        self.available = True

    async def _check_epoch(self, client: Redis) -> None:
        key = f"{self.prefix}:epoch"
        epoch = await client.get(key)
        if epoch is not None and epoch == self._epoch:
            return
        if epoch is None:
            await client.set(key, secrets.token_hex(8), nx=True)
            epoch = await client.get(key)
        if self._epoch is not None:
            log.warning("KV index backend %s lost its data: resyncing", self.url)
        self._epoch = epoch if isinstance(epoch, bytes) else None
        self._slots.clear()
        self._slot_addresses.clear()
        self._dirty.update(a for a in map(self._address_of, self.ledger.endpoint_ids()) if a)

    async def _slot(self, client: Redis, address: str) -> int:
        slot = self._slots.get(address)
        if slot is None:
            slot = int(
                await self._scripts["slot"](
                    keys=[f"{self.prefix}:slot", f"{self.prefix}:next-slot"],
                    args=[address],
                    client=client,
                )
            )
            self._slots[address] = slot
            self._slot_addresses[slot] = address
        return slot

    async def _resync(self, client: Redis, address: str) -> None:
        slot = await self._slot(client, address)
        await self._scripts["clear"](
            keys=[f"{self.prefix}:e:{address}"], args=[slot, f"{self.prefix}:b:"], client=client
        )
        endpoint_id = self._id_of(address)
        if endpoint_id is None:
            return
        keys = list(self.ledger.keys(endpoint_id))
        for start in range(0, len(keys), _RESYNC_CHUNK):
            pipe = client.pipeline(transaction=False)
            self._queue_add(pipe, address, slot, keys[start : start + _RESYNC_CHUNK])
            await pipe.execute()

    def _id_of(self, address: str) -> int | None:
        for endpoint_id in self.ledger.endpoint_ids():
            if self._address_of(endpoint_id) == address:
                return endpoint_id
        return None

    # -- writes -----------------------------------------------------------------------------

    def _queue(self, op: int, endpoint_id: int, keys: list[int]) -> None:
        address = self._address_of(endpoint_id)
        if address is None:
            # The store forgets an endpoint before telling us it left: use what we saw.
            address = self._known_addresses.get(endpoint_id)
            if address is None:
                return
        else:
            self._known_addresses[endpoint_id] = address
        if len(self._ops) >= _MAX_QUEUED_OPS:
            self._dirty.add(address)
            return
        self._ops.append((op, address, keys))
        self._wake.set()

    def _drop_queue(self) -> None:
        for _, address, _ in self._ops:
            self._dirty.add(address)
        self._ops.clear()

    def _key(self, key: int) -> str:
        return f"{self.prefix}:b:{key:016x}"

    def _queue_add(self, pipe: Any, address: str, slot: int, keys: list[int]) -> None:
        if not keys:
            return
        for key in keys:
            pipe.setbit(self._key(key), slot, 1)
        pipe.sadd(f"{self.prefix}:e:{address}", *(f"{key:016x}" for key in keys))

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every write queued so far has been sent (or dropped by an outage)."""
        async with asyncio.timeout(timeout_s):
            while self._ops or self._flushing:
                await asyncio.sleep(0.002)

    async def _flush(self) -> None:
        ops, self._ops = self._ops, []
        if not ops:
            return
        self._flushing = True
        try:
            await self._send(ops)
        finally:
            self._flushing = False

    async def _send(self, ops: list[tuple[int, str, list[int]]]) -> None:
        client = self._connect()
        prefix = self.prefix
        try:
            slots = {address: await self._slot(client, address) for _, address, _ in ops}
            pipe = client.pipeline(transaction=False)
            pipe.get(f"{prefix}:epoch")
            for op, address, keys in ops:
                slot = slots[address]
                if op == _ADD:
                    self._queue_add(pipe, address, slot, keys)
                    continue
                # Scripts are queued on the pipeline (the await only stages the call).
                if op == _REMOVE:
                    await self._scripts["unset"](
                        keys=[self._key(key) for key in keys], args=[slot], client=pipe
                    )
                    pipe.srem(f"{prefix}:e:{address}", *(f"{key:016x}" for key in keys))
                else:
                    await self._scripts["clear"](
                        keys=[f"{prefix}:e:{address}"], args=[slot, f"{prefix}:b:"], client=pipe
                    )
            results = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            for _, address, _ in ops:
                self._dirty.add(address)
            self._failed("write", exc)
            return
        if results and results[0] != self._epoch:
            await self._check()

    # -- events (the KVIndex contract, as in process) ---------------------------------------

    def apply_stored(self, endpoint_id: int, event: BlockStored, model: str) -> int:
        """Apply a ``BlockStored`` of ``model``'s blocks; returns the number of blocks indexed."""
        engine_hashes = event.block_hashes
        keys = self.event_keys.stored_keys(self.ledger, endpoint_id, event, model)
        if not keys:
            return 0
        ledger = self.ledger
        for engine_hash, key in zip(engine_hashes, keys, strict=False):
            replaced = ledger.add(endpoint_id, engine_hash, key)
            if replaced is not None:
                self._queue(_REMOVE, endpoint_id, [replaced])
        self._queue(_ADD, endpoint_id, keys)
        ledger.trim(endpoint_id)
        return len(keys)

    def apply_removed(self, endpoint_id: int, event: BlockRemoved) -> int:
        """Apply a ``BlockRemoved``; returns the number of blocks that were indexed."""
        keys = []
        for engine_hash in event.block_hashes:
            key = self.ledger.pop(endpoint_id, engine_hash)
            if key is not None:
                keys.append(key)
        if keys:
            self._queue(_REMOVE, endpoint_id, keys)
        return len(keys)

    def clear_endpoint(self, endpoint_id: int) -> int:
        """Apply ``AllBlocksCleared`` (or a lost event stream); returns blocks dropped."""
        dropped = len(self.ledger.clear(endpoint_id))
        self._queue(_CLEAR_ALL, endpoint_id, [])
        return dropped

    def remove_endpoint(self, endpoint_id: int) -> None:
        """The endpoint left the pool: clear it in Redis too (its id may be reused)."""
        self.ledger.clear(endpoint_id, forget=True)
        self._queue(_CLEAR_ALL, endpoint_id, [])
        self._known_addresses.pop(endpoint_id, None)

    def _evicted(self, endpoint_id: int, key: int) -> None:
        self._queue(_REMOVE, endpoint_id, [key])

    # -- sizes ------------------------------------------------------------------------------

    def num_blocks(self) -> int:
        """(endpoint, block) entries this replica tracks."""
        return self.ledger.size

    def num_keys(self) -> None:
        """Not known: counting the shared index's keys would cost a scan of Redis."""
        return None

    def num_evicted_blocks(self) -> int:
        """Entries this replica evicted to respect its bounds since start."""
        return self.ledger.evicted_blocks

    # -- lookup -----------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[int]) -> Coroutine[None, None, dict[str, int] | None] | None:
        """The lookup of ``keys`` to await before the schedule; None when it would give nothing.

        None without keys, and while Redis is unavailable (no coroutine for a lookup that
        could only answer "no signal"; the writer task probes and turns the signal back on).
        """
        if not keys or not self.available:
            return None
        return self.lookup(keys)

    def runs(
        self,
        keys: Sequence[int],
        candidate_mask: int,
        runs_out: list[int],
        prefetched: Prefetched | None = None,
        speculative: SpeculativeHolders | None = None,
    ) -> int:
        """Each candidate's leading run: the longer of Redis's (prefetched) and the speculative.

        See :meth:`kv_picker.state.kv_index.KVIndex.runs`. Without ``prefetched`` (no prepare
        step ran, or Redis was unavailable) only the speculative holders count.
        """
        overlay = speculative.maps() if speculative is not None else None
        # Writes every candidate's speculative run (0 without an overlay) and sizes the buffer.
        best = leading_runs(keys, candidate_mask, runs_out, _NOTHING_HELD, overlay)
        if not prefetched:
            return best
        address_of = self._address_of
        mask = candidate_mask
        while mask:
            low = mask & -mask
            mask ^= low
            endpoint_id = low.bit_length() - 1
            address = address_of(endpoint_id)
            run = prefetched.get(address, 0) if address is not None else 0
            if run > runs_out[endpoint_id]:
                runs_out[endpoint_id] = run
                if run > best:
                    best = run
        return best

    async def lookup(self, keys: Sequence[int]) -> dict[str, int] | None:
        """Each endpoint's leading run for ``keys``, by address; None when Redis is unavailable.

        Endpoints that hold none of block 0 are absent. Never raises.
        """
        if not keys:
            return {}
        if not self.available:
            return None  # the writer task probes, resyncs, and turns the signal back on
        self.lookups += 1
        try:
            client = self._connect()
            async with asyncio.timeout(self.timeout_s):
                flat = await self._scripts["lookup"](keys=[self._key(k) for k in keys])
                addresses = self._slot_addresses
                if any(flat[i] not in addresses for i in range(0, len(flat), 2)):
                    # An endpoint another replica numbered: learn the numbering (rare).
                    table = await client.hgetall(f"{self.prefix}:slot")
                    for raw_address, slot in table.items():
                        address = (
                            raw_address.decode() if isinstance(raw_address, bytes) else raw_address
                        )
                        addresses[int(slot)] = address
                        self._slots[address] = int(slot)
        except (RedisError, OSError, TimeoutError) as exc:
            self.failed_lookups += 1
            self._failed("lookup", exc)
            self._wake.set()  # the writer task probes and resyncs
            return None
        return {
            addresses[flat[i]]: int(flat[i + 1])
            for i in range(0, len(flat), 2)
            if flat[i] in addresses
        }
