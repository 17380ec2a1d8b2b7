"""vLLM's KV-cache events from the prefix cache, for gateways that route by cached prefix (--kv-events-config).

The wire format is vLLM's (vllm/distributed/kv_events.py, the msgspec structs with array_like=True that its consumers
decode: llm-d's kv-cache indexer, Dynamo's ZMQ relay, SGLang's router): each message on the PUB socket is three
frames, [topic, sequence number (8 bytes, big-endian, from 0), msgpack KVEventBatch]. A KVEventBatch is the array
[ts, events, data_parallel_rank]; each event a tagged array:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]
One block is one KV page; its hash is chained over its prefix (kvcache/events.py). The replay socket (a ROUTER) answers
a request [8-byte start sequence] with every buffered batch from that sequence on, each [sequence, payload], then the
end marker [-1, empty payload], as vLLM's does: a subscriber that joins late or sees a gap catches up there.

Off the step's critical path: the radix cache appends plain records to a list (kvcache/events.py), the engine hands
the step's list to publish() (a queue put), and this module's thread builds the messages, sends them and answers
replay requests. Only tensor-parallel rank 0 publishes (the ranks' caches are the same).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from ..config import KVEventsConfig
from ..kvcache.events import CacheCleared, CacheEvent, PagesRemoved, PagesStored

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_REPLAY_POLL_S = 0.05  # with a replay socket, how long the thread waits for a batch before it looks for requests


# ---- the schema: vLLM's field order and tags --------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name: the first element of each event's array."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def to_wire(record: CacheEvent, block_size: int, medium: str) -> KVCacheEvent:
    if isinstance(record, PagesStored):
        return BlockStored(record.hashes, record.parent_hash, record.token_ids, block_size, None, medium, None)
    if isinstance(record, PagesRemoved):
        return BlockRemoved(record.hashes, medium)
    assert isinstance(record, CacheCleared), record
    return AllBlocksCleared()


def endpoint_for_rank(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's convention for data-parallel replicas: replica r publishes on the configured TCP port + r (an ipc or
    inproc address gets the suffix _dp<r>)."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard address or a local one, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The PUB socket, the replay socket and the thread that owns both once started. Bind errors (a port in use) are
    raised by the constructor, naming the key and the address."""

    def __init__(self, config: KVEventsConfig, block_size: int, medium: str, data_parallel_rank: int = 0):
        self.block_size, self.medium, self.data_parallel_rank = block_size, medium, data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay = None
        endpoint = endpoint_for_rank(config.endpoint, data_parallel_rank)
        replay_endpoint = endpoint_for_rank(config.replay_endpoint, data_parallel_rank)
        try:
            self._open(self._pub, "endpoint", endpoint, _binds(endpoint))
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._open(self._replay, "replay_endpoint", replay_endpoint, True)
        except BaseException:
            self._close_sockets()
            raise
        self._failed = False  # the thread hit an error and stopped: later batches are dropped, not queued
        self._thread = threading.Thread(target=self._run, name="fastqwen-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV-cache events: publishing on %s%s, topic %r",
            endpoint,
            f", replay on {replay_endpoint}" if replay_endpoint else "",
            config.topic,
        )

    @staticmethod
    def _open(socket, key: str, endpoint: str, bind: bool) -> None:
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except zmq.ZMQError as e:
            raise RuntimeError(
                f"kv_events_config's {key}: cannot {'bind' if bind else 'connect'} {endpoint}: {e} (--kv-events-config)"
            ) from None

    def publish(self, records: list[CacheEvent]) -> None:
        """Queue one step's records (the engine's thread: a put, which waits only while max_queue_size batches are
        still unsent, as vLLM's does: dropping one would leave every subscriber's picture wrong)."""
        if records and not self._failed:
            self._queue.put((time.time(), records))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:  # the thread is stuck or gone
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the KV-event publisher did not finish sending within %.0f s", timeout)

    # ---- the publisher thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        sequence = 0
        wait = _REPLAY_POLL_S if self._replay is not None else None
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._answer_replay()
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    continue
                if item is None:
                    return
                ts, records = item
                events = [to_wire(r, self.block_size, self.medium) for r in records]
                payload = encoder.encode(KVEventBatch(ts, events, self.data_parallel_rank))
                number = sequence.to_bytes(8, "big")
                self._pub.send_multipart([self._topic, number, payload])
                self._buffer.append((sequence, payload))
                sequence += 1
        except Exception:
            self._failed = True
            log.exception("the KV-event publisher failed; no more events are sent")
        finally:
            self._close_sockets()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        # [identity, empty delimiter, start sequence]: from a REQ socket, or a DEALER that sends b"" first
        identity = frames[0]
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("a malformed KV-event replay request (%d frames): answered with the end marker", len(frames))
            self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])
            return
        start_sequence = int.from_bytes(frames[2], "big")
        for sequence, payload in self._buffer:
            if sequence >= start_sequence:
                self._replay.send_multipart([identity, b"", sequence.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=1000)  # a second for subscribers to receive the last batches
        self._context.term()
