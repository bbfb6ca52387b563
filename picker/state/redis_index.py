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
    {prefix}:blk:<key>      STRING, one byte per slot: bit 7 - t set when tier t of the slot's
                            endpoint holds the block (SETBIT offset slot * 8 + t)
    {prefix}:ep:<address>   SET of the endpoint's "<key><tier>" members (to clear it in one call)
    {prefix}:epoch          a token written once; when it changes or vanishes, Redis lost
                            its data and every writer resyncs what it knows

Lookup is one ``EVALSHA`` (``_LOOKUP``, the tier weights passed in thousandths): walk the
request's keys in order, keep the slots whose byte is not zero, stop when no slot is left,
return each slot's run and weighted run (each block weighs its best tier's weight). Consecutive
blocks of a prefix are almost always held by the same endpoints in the same tiers, so their
bitmaps are the same bytes: the script compares each block's bitmap with the previous one and
only does per-slot work when they differ, which makes a lookup one ``GET`` per block (a
set-per-block layout costs a membership probe per block and holder, about 50x more at 256
endpoints). Writes are batched: events apply at once to a local ledger
(:mod:`kv_picker.state.block_ledger`; it resolves engine hashes to keys, keeps entries per
(endpoint, tier, group) and enforces the bounds, exactly as in-process), and the resulting bit
operations are pipelined to Redis every few milliseconds. Replicas must agree on the tiers
(``index.tierWeights``' names); the weights are each replica's own.

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
from kv_picker.state.block_ledger import Ledger
from kv_picker.state.compact_ledger import LEDGERS, LedgerLayout
from kv_picker.state.kv_index import Prefetched, SpeculativeHolders
from kv_picker.state.prefix_runs import leading_runs

log = logging.getLogger(__name__)

_LOOKUP = """
local weights = {}
for t = 1, #ARGV do weights[t] = tonumber(ARGV[t]) end
local best = {}
local function weight_of(b)
  local w = best[b]
  if w == nil then
    w = 0
    for t = 1, #weights do
      if bit.band(b, bit.rshift(128, t - 1)) ~= 0 and weights[t] > w then w = weights[t] end
    end
    best[b] = w
  end
  return w
end
local first = redis.call('GET', KEYS[1])
local out = {}
if not first then return out end
local cur = {string.byte(first, 1, -1)}
local alive = {}
local score = {}
local left = 0
for j = 1, #cur do
  if cur[j] ~= 0 then alive[j] = true; score[j] = 0; left = left + 1 end
end
if left == 0 then return out end
local since = 0
local function settle(upto)
  for j in pairs(alive) do score[j] = score[j] + weight_of(cur[j]) * (upto - since) end
  since = upto
end
local prev = first
for i = 2, #KEYS do
  local raw = redis.call('GET', KEYS[i])
  if raw ~= prev then
    prev = raw
    settle(i - 1)
    for j in pairs(alive) do
      local b = 0
      if raw then b = string.byte(raw, j) or 0 end
      if b == 0 then
        alive[j] = nil
        left = left - 1
        out[#out + 1] = j - 1
        out[#out + 1] = i - 1
        out[#out + 1] = score[j]
      else
        cur[j] = b
      end
    end
    if left == 0 then return out end
  end
end
settle(#KEYS)
for j in pairs(alive) do
  out[#out + 1] = j - 1
  out[#out + 1] = #KEYS
  out[#out + 1] = score[j]
end
return out
"""

# KEYS: block bitmaps; ARGV[1]: the bit of the endpoint's slot and tier. Empty bitmaps are
# deleted.
_UNSET = """
local offset = tonumber(ARGV[1])
for _, key in ipairs(KEYS) do
  redis.call('SETBIT', key, offset, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end
return #KEYS
"""

# KEYS[1]: the endpoint's key set; ARGV: slot, bitmap key prefix. Members are "<key><tier>".
_CLEAR = """
local slot = tonumber(ARGV[1])
local members = redis.call('SMEMBERS', KEYS[1])
for _, member in ipairs(members) do
  local key = ARGV[2] .. string.sub(member, 1, 16)
  redis.call('SETBIT', key, slot * 8 + tonumber(string.sub(member, 17)), 0)
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
        layout: the local ledger's (see :class:`~kv_picker.state.kv_index.KVBlockIndex`).
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
        layout: LedgerLayout = "compact",
    ) -> None:
        self.event_keys = event_keys
        self.url = url.replace("valkey://", "redis://", 1).replace("valkeys://", "rediss://", 1)
        self.prefix = key_prefix
        self._address_of = address_of
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.ledger: Ledger = LEDGERS[layout](
            default_capacity_blocks, max_blocks, capacity_source, self._unheld
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
        self._ops: list[tuple[int, str, int, list[int]]] = []  # (op, address, tier, keys)
        # Lookup arguments: each tier's weight in thousandths (Lua returns integers).
        self._weight_args = [round(w * 1000) for w in event_keys.tiers.weights]
        self._gpu_weight = event_keys.tiers.weights[0]
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
        task = asyncio.current_task()
        self._connect()
        await self._check()
        while True:
            # A cancellation that arrives during a Redis call can be caught inside the client
            # and not raised again; it still counts on the task (Task.cancelling), so the loop
            # ends here instead of waiting for a second one (a shutdown would hang on it).
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
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
            keys=[self._endpoint_key(address)], args=[slot, self._block_prefix], client=client
        )
        endpoint_id = self._id_of(address)
        if endpoint_id is None:
            return
        by_tier: dict[int, set[int]] = {}
        for tier, key in self.ledger.held(endpoint_id):
            by_tier.setdefault(tier, set()).add(key)
        for tier, held in by_tier.items():
            keys = list(held)
            for start in range(0, len(keys), _RESYNC_CHUNK):
                pipe = client.pipeline(transaction=False)
                self._queue_add(pipe, address, slot, tier, keys[start : start + _RESYNC_CHUNK])
                await pipe.execute()

    def _id_of(self, address: str) -> int | None:
        for endpoint_id in self.ledger.endpoint_ids():
            if self._address_of(endpoint_id) == address:
                return endpoint_id
        return None

    # -- writes -----------------------------------------------------------------------------

    def _queue(self, op: int, endpoint_id: int, tier: int, keys: list[int]) -> None:
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
        self._ops.append((op, address, tier, keys))
        self._wake.set()

    def _drop_queue(self) -> None:
        for _, address, _, _ in self._ops:
            self._dirty.add(address)
        self._ops.clear()

    @property
    def _block_prefix(self) -> str:
        return f"{self.prefix}:blk:"

    def _key(self, key: int) -> str:
        return f"{self.prefix}:blk:{key:016x}"

    def _endpoint_key(self, address: str) -> str:
        return f"{self.prefix}:ep:{address}"

    def _queue_add(self, pipe: Any, address: str, slot: int, tier: int, keys: list[int]) -> None:
        if not keys:
            return
        offset = slot * 8 + tier
        for key in keys:
            pipe.setbit(self._key(key), offset, 1)
        pipe.sadd(self._endpoint_key(address), *(f"{key:016x}{tier}" for key in keys))

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

    async def _send(self, ops: list[tuple[int, str, int, list[int]]]) -> None:
        client = self._connect()
        prefix = self.prefix
        try:
            slots = {address: await self._slot(client, address) for _, address, _, _ in ops}
            pipe = client.pipeline(transaction=False)
            pipe.get(f"{prefix}:epoch")
            for op, address, tier, keys in ops:
                slot = slots[address]
                if op == _ADD:
                    self._queue_add(pipe, address, slot, tier, keys)
                    continue
                # Scripts are queued on the pipeline (the await only stages the call).
                if op == _REMOVE:
                    await self._scripts["unset"](
                        keys=[self._key(key) for key in keys], args=[slot * 8 + tier], client=pipe
                    )
                    pipe.srem(self._endpoint_key(address), *(f"{key:016x}{tier}" for key in keys))
                else:
                    await self._scripts["clear"](
                        keys=[self._endpoint_key(address)],
                        args=[slot, self._block_prefix],
                        client=pipe,
                    )
            results = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            for _, address, _, _ in ops:
                self._dirty.add(address)
            self._failed("write", exc)
            return
        if results and results[0] != self._epoch:
            await self._check()

    # -- events (the KVIndex contract, as in process) ---------------------------------------

    def apply_stored(self, endpoint_id: int, event: BlockStored, model: str) -> int:
        """Apply a ``BlockStored`` of ``model``'s blocks; returns the number of blocks indexed."""
        stored = self.event_keys.stored_keys(self.ledger, endpoint_id, event, model)
        if stored is None:
            return 0
        tier, group, engine_hashes, keys = stored
        self.ledger.store(endpoint_id, tier, group, engine_hashes, keys)
        self._queue(_ADD, endpoint_id, tier, keys)
        self.ledger.trim(endpoint_id, tier)
        return len(keys)

    def apply_removed(self, endpoint_id: int, event: BlockRemoved) -> int:
        """Apply a ``BlockRemoved`` of its (medium, group); returns the entries it hit."""
        return self.event_keys.apply_removed(self.ledger, endpoint_id, event)

    def clear_endpoint(self, endpoint_id: int) -> int:
        """Apply ``AllBlocksCleared`` (or a lost event stream); returns blocks dropped."""
        before = self.ledger.size
        self.ledger.clear(endpoint_id)
        self._queue(_CLEAR_ALL, endpoint_id, 0, [])
        return before - self.ledger.size

    def remove_endpoint(self, endpoint_id: int) -> None:
        """The endpoint left the pool: clear it in Redis too (its id may be reused)."""
        self.ledger.clear(endpoint_id, forget=True)
        self._queue(_CLEAR_ALL, endpoint_id, 0, [])
        self._known_addresses.pop(endpoint_id, None)

    def _unheld(self, endpoint_id: int, tier: int, key: int) -> None:
        # Consecutive removals of one (endpoint, tier) share one queued operation.
        ops = self._ops
        if ops:
            op, address, last_tier, keys = ops[-1]
            if (
                op == _REMOVE
                and last_tier == tier
                and address == self._known_addresses.get(endpoint_id)
            ):
                keys.append(key)
                return
        self._queue(_REMOVE, endpoint_id, tier, [key])

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

    def prefetch(
        self, keys: Sequence[int]
    ) -> Coroutine[None, None, dict[str, tuple[int, float]] | None] | None:
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
        weighted_out: list[float] | None = None,
    ) -> int:
        """Each candidate's leading run: the longer of Redis's (prefetched) and the speculative.

        See :meth:`kv_picker.state.kv_index.KVIndex.runs`. Without ``prefetched`` (no prepare
        step ran, or Redis was unavailable) only the speculative holders count. The weighted
        run is the larger of Redis's and the speculative run's (GPU-weighted); a mix of both
        within one run is not added up.
        """
        overlay = speculative.maps() if speculative is not None else None
        # Writes every candidate's speculative run (0 without an overlay) and sizes the buffer.
        best = leading_runs(keys, candidate_mask, runs_out, _NOTHING_HELD, overlay)
        if weighted_out is not None:
            short = candidate_mask.bit_length() - len(weighted_out)
            if short > 0:
                weighted_out.extend([0.0] * short)
            gpu_weight = self._gpu_weight
        address_of = self._address_of
        mask = candidate_mask
        while mask:
            low = mask & -mask
            mask ^= low
            endpoint_id = low.bit_length() - 1
            run = runs_out[endpoint_id]
            weighted = run * gpu_weight if weighted_out is not None else 0.0
            if prefetched:
                address = address_of(endpoint_id)
                found = prefetched.get(address) if address is not None else None
                if found is not None:
                    if found[0] > run:
                        run = runs_out[endpoint_id] = found[0]
                        if run > best:
                            best = run
                    if found[1] > weighted:
                        weighted = found[1]
            if weighted_out is not None:
                weighted_out[endpoint_id] = weighted
        return best

    async def lookup(self, keys: Sequence[int]) -> dict[str, tuple[int, float]] | None:
        """Each endpoint's (leading run, weighted run) for ``keys``, by address; None when
        Redis is unavailable.

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
                flat = await self._scripts["lookup"](
                    keys=[self._key(k) for k in keys], args=self._weight_args
                )
                addresses = self._slot_addresses
                if any(flat[i] not in addresses for i in range(0, len(flat), 3)):
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
            addresses[flat[i]]: (int(flat[i + 1]), flat[i + 2] / 1000)
            for i in range(0, len(flat), 3)
            if flat[i] in addresses
        }
