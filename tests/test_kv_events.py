"""KV-cache events (--kv-events-config): what the radix cache records rebuilds exactly the pages its tree holds, and
a real server's ZeroMQ stream, decoded with a schema written here from vLLM's documented format, rebuilds exactly the
pages the server's cache holds, for a subscriber there from the start and for one that joins late through the
replay socket.

The reference for the cache is a walk of the tree, keyed by each page's whole prefix of tokens (never by the hashes
under test); the reference for a server is its count of cached pages (/server_info) and the token ids it was sent
and gave back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import pytest
import zmq
from checkpoints import make_checkpoint
from fastqwen.config import ConfigError, EngineConfig, GenerationDefaults
from fastqwen.kvcache import PageAllocator, RadixCache, check_kv_invariants
from fastqwen.kvcache.events import CacheCleared, PagesRemoved, PagesStored
from fastqwen.sampling_params import SamplingParams
from fastqwen.scheduler import Request, Scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess, free_port

# ---- the radix cache's record against a walk of its tree -------------------------------------------------------


def tree_prefixes(cache: RadixCache) -> set[tuple[int, ...]]:
    """Every page in the tree, named by the tokens from the root to the end of that page."""
    found, stack = set(), [(cache.root, ())]
    while stack:
        node, before = stack.pop()
        for at in range(0, len(node.key), cache.page_size):
            found.add(before + node.key[: at + cache.page_size])
        stack.extend((child, before + node.key) for child in node.children.values())
    return found


class RebuiltPages:
    """A subscriber's picture: hash -> (parent hash, the page's tokens), kept by applying records in order."""

    def __init__(self):
        self.pages: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.stored = self.removed = 0

    def store(self, hashes, parent, tokens, page_size) -> None:
        assert len(tokens) == len(hashes) * page_size
        for i, h in enumerate(hashes):
            assert h not in self.pages, f"page {h} stored twice"
            assert parent is None or parent in self.pages, f"page {h} stored under unknown parent {parent}"
            self.pages[h] = (parent, tuple(tokens[i * page_size : (i + 1) * page_size]))
            parent = h
        self.stored += len(hashes)

    def remove(self, hashes) -> None:
        for h in hashes:
            assert h in self.pages, f"page {h} removed but never stored (or removed twice)"
            del self.pages[h]
        self.removed += len(hashes)

    def prefix(self, h: int) -> tuple[int, ...]:
        tokens = ()
        while h is not None:
            assert h in self.pages, f"a page's parent {h} is gone: the tree is not closed under prefixes"
            h, own = self.pages[h]
            tokens = own + tokens
        return tokens

    def prefixes(self) -> set[tuple[int, ...]]:
        return {self.prefix(h) for h in self.pages}


def apply_records(rebuilt: RebuiltPages, records, page_size: int) -> None:
    for record in records:
        if isinstance(record, PagesStored):
            rebuilt.store(record.hashes, record.parent_hash, record.token_ids, page_size)
        elif isinstance(record, PagesRemoved):
            rebuilt.remove(record.hashes)
        else:
            assert isinstance(record, CacheCleared)
            rebuilt.pages.clear()


class _Driver:
    """A Scheduler over a recording RadixCache, driven with made-up tokens (no model); prompts share prefixes so that
    matches split nodes."""

    def __init__(self, num_pages: int, page_size: int, budget: int, seed: int):
        import random

        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, page_size, record_events=True)
        self.scheduler = Scheduler(self.allocator, page_size, 6, budget, 64, [0], self.cache)
        self.rebuilt = RebuiltPages()
        self.rng = random.Random(seed)
        self.next_rid = 0

    def admit(self, base: int, extra: int, max_tokens: int) -> None:
        prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15][: base + 1] + [self.rng.randrange(1, 4) for _ in range(extra)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        params = params.with_defaults(GenerationDefaults())
        request = Request(rid=self.next_rid, prompt_ids=prompt, params=params, arrival=self.next_rid)
        self.next_rid += 1
        try:
            self.scheduler.add(request)
        except ValueError:
            pass  # too long for the little pool

    def step(self) -> None:
        batch = self.scheduler.schedule()
        self.scheduler.update(batch, [self.rng.randrange(1, 4) for c in batch.chunks if c.samples])

    def abort(self, pick: int) -> None:
        everyone = list(self.scheduler.running) + list(self.scheduler.waiting)
        if everyone:
            self.scheduler.abort(everyone[pick % len(everyone)].rid)

    def evict(self, pages: int) -> None:
        self.cache.evict(pages)

    def reset(self) -> None:
        self.cache.reset()

    def check(self) -> None:
        check_kv_invariants(self.allocator, self.cache, self.scheduler.running, self.scheduler.waiting)
        apply_records(self.rebuilt, self.cache.take_events(), self.cache.page_size)
        assert self.rebuilt.prefixes() == tree_prefixes(self.cache)
        assert len(self.rebuilt.pages) == self.cache.num_pages


_operation = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 8), st.integers(0, 12), st.integers(1, 8)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(1, 10)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_pages=st.integers(4, 24),
    page_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 20),
    operations=st.lists(_operation, min_size=1, max_size=50),
)
def test_the_record_rebuilds_exactly_the_pages_of_the_tree(num_pages, page_size, budget, operations):
    """After every insert, split (a match inside a node), eviction, abort and reset, the pages rebuilt from the record
    are the tree's pages, each with its whole prefix.

    Mutation checks (run once, not committed): not recording PagesRemoved in evict, recording a removal in _split, or
    chaining a new node's hashes from the root instead of its parent each fail this test."""
    driver = _Driver(num_pages, page_size, budget, seed=num_pages * 31 + budget)
    for op in operations:
        getattr(driver, op[0])(*op[1:])
        driver.check()
    for _ in range(2000):
        if not driver.scheduler.has_work():
            break
        driver.step()
        driver.check()
    driver.evict(num_pages)
    driver.check()
    assert driver.rebuilt.pages == {} and driver.allocator.num_free() == num_pages


def test_a_split_reports_nothing_and_hashes_name_the_prefix():
    """A match that ends inside a node splits it without a record, and the same prefix gets the same hashes in
    another cache (another replica, another restart)."""
    allocator = PageAllocator(16)
    cache = RadixCache(allocator, 2, record_events=True)
    pages = allocator.alloc(4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], pages)
    (stored,) = cache.take_events()
    assert len(stored.hashes) == 4 and stored.parent_hash is None
    hit, _ = cache.match_prefix([1, 2, 3, 4, 9])  # splits the node after two pages
    assert hit == pages[:2] and len(cache.root.children[(1, 2)].children) == 1
    assert cache.take_events() == []
    other = RadixCache(PageAllocator(16), 2, record_events=True)
    other.insert([1, 2, 3, 4], other.allocator.alloc(2))
    other.insert([1, 2, 3, 4, 9, 9], other.allocator.alloc(3))
    first, second = other.take_events()
    assert first.hashes == stored.hashes[:2]
    assert second.parent_hash == stored.hashes[1] and second.hashes[0] not in stored.hashes


def test_without_events_the_cache_records_nothing():
    allocator = PageAllocator(8)
    cache = RadixCache(allocator, 2)
    cache.insert([1, 2, 3, 4], allocator.alloc(2))
    cache.evict(2)
    assert cache.events is None and cache.root.children == {}


@pytest.mark.parametrize(
    "text, names",
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "port": 5557}', "unknown keys ['port']"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": "localhost:5557"}', "endpoint"),
        ('{"replay_endpoint": 5558}', "replay_endpoint"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"topic": 3}', "topic"),
    ],
)
def test_a_bad_kv_events_config_is_refused_naming_what_is_wrong(text, names):
    with pytest.raises(ConfigError) as e:
        EngineConfig(model="m", kv_events_config=text)
    assert e.value.field == "kv_events_config" and names in str(e.value)


def test_kv_events_config_takes_vllms_keys_and_defaults():
    config = EngineConfig(model="m", kv_events_config='{"enable_kv_cache_events": true, "topic": "kv@p@m"}')
    events = config.kv_events_config
    assert (events.publisher, events.endpoint, events.replay_endpoint, events.topic) == (
        "zmq",
        "tcp://*:5557",
        None,
        "kv@p@m",
    )
    assert events.publishes and not EngineConfig(model="m", kv_events_config="{}").kv_events_config.publishes


# ---- a real server's stream, decoded with a schema written from vLLM's documented format ------------------------


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


PAGE = 16
TOPIC = "kv@pod-0@tiny-qwen3"


class Subscriber:
    """What a gateway does: SUB to the stream, every batch applied in sequence order; a gap (a late join, a slow
    connect) is filled from the replay socket (a DEALER speaking to the server's ROUTER)."""

    def __init__(self, pub: str, replay: str, bind_pub: bool = False):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.bind(pub) if bind_pub else self.sub.connect(pub)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.rebuilt = RebuiltPages()
        self.next_sequence = 0
        self.replayed = 0  # batches applied from the replay socket
        self.live = 0  # batches received on the stream

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.context.term()

    def apply(self, sequence: int, payload: bytes) -> None:
        assert sequence == self.next_sequence, (sequence, self.next_sequence)
        batch = self.decoder.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == PAGE and event.medium == "CPU" and event.lora_id is None
                self.rebuilt.store(event.block_hashes, event.parent_block_hash, event.token_ids, PAGE)
            elif isinstance(event, BlockRemoved):
                self.rebuilt.remove(event.block_hashes)
            else:
                self.rebuilt.pages.clear()
        self.next_sequence += 1

    def catch_up(self) -> None:
        """Ask for every buffered batch from the next one expected; apply them until the end marker."""
        self.replay.send_multipart([b"", self.next_sequence.to_bytes(8, "big")])
        while True:
            assert self.replay.poll(10_000), "no answer from the replay socket"
            empty, number, payload = self.replay.recv_multipart()
            sequence = int.from_bytes(number, "big", signed=True)
            if sequence == -1:
                assert payload == b""
                return
            self.replayed += 1
            self.apply(sequence, payload)

    def pump(self, timeout_ms: int) -> None:
        """Apply what arrives within timeout_ms (a batch past a gap first fills the gap by replay)."""
        while self.sub.poll(timeout_ms):
            timeout_ms = 0
            topic, number, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode()
            self.live += 1
            sequence = int.from_bytes(number, "big")
            if sequence > self.next_sequence:
                self.catch_up()
            if sequence == self.next_sequence:
                self.apply(sequence, payload)

    def go_live(self, server: ServerProcess) -> list[tuple[list[int], bool]]:
        """Send one-page requests until one's batch arrives on the stream. ZeroMQ hands a subscription to the
        publisher only once the subscriber's socket is used and connected; until then the PUB socket drops what it
        sends, so a subscriber cannot otherwise know that it will see the next batch live. Returns what was sent."""
        sent = []
        for n in range(1, 100):
            prompt = [n] * PAGE + [n + 1]
            sampling = {"temperature": 0.0, "max_new_tokens": 1}
            r = httpx.post(server.url + "/generate", json={"input_ids": prompt, "sampling_params": sampling})
            assert r.status_code == 200, r.text
            sent.append((prompt + r.json()["output_ids"], False))
            live = self.live
            self.pump(500)
            if self.live > live:
                return sent
        raise AssertionError("no batch arrived on the stream")

    def agree_with(self, server: ServerProcess, timeout: float = 10.0) -> int:
        """Pump until the rebuilt pages are as many as the server's cache holds (its stats settle once idle); returns
        that count."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump(100)
            info = httpx.get(server.url + "/server_info").json()
            cached = info["internal_states"][0]["num_cached_pages"]
            if cached == len(self.rebuilt.pages) or time.monotonic() > deadline:
                assert len(self.rebuilt.pages) == cached, (len(self.rebuilt.pages), cached)
                return cached


def check_contents(rebuilt: RebuiltPages, sequences: list[tuple[list[int], bool]]) -> None:
    """Every rebuilt page's whole prefix is a prefix of the tokens of a request that ran (its prompt and output;
    only its prompt where it was cut off and its output is unknown)."""
    for prefix in rebuilt.prefixes():
        assert any(
            list(prefix[: len(tokens)]) == tokens[: len(prefix)] and (len(prefix) <= len(tokens) or cut)
            for tokens, cut in sequences
        ), f"a rebuilt prefix the server never computed: {prefix[:24]}..."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kv-events"))
    make_checkpoint(path, tied=True, seed=45, max_positions=512)
    return path


def start_server(folder: str, events: dict, *extra: str) -> ServerProcess:
    # 24 pages of 16 tokens: the workload below needs more, so the cache evicts.
    engine = ["--dtype", "float32", "--device", "cpu", "--num-pages", "24", "--page-size", str(PAGE)]
    config = {"enable_kv_cache_events": True, "topic": TOPIC, **events}
    return ServerProcess(folder, *engine, "--max-model-len", "256", "--kv-events-config", json.dumps(config), *extra)


def workload(server: ServerProcess, seed: int) -> list[tuple[list[int], bool]]:
    """Groups sharing a 3-page system prompt (matches split nodes), unrelated prompts, then one stream cut off after
    two pages of output (an abort). Returns (tokens, whether cut off) for each."""
    import random

    rng = random.Random(seed)
    prompts = []
    for _ in range(3):
        system = [rng.randrange(1, 380) for _ in range(3 * PAGE)]
        prompts += [system + [rng.randrange(1, 380) for _ in range(rng.randrange(10, 30))] for _ in range(2)]
    prompts += [[rng.randrange(1, 380) for _ in range(70)] for _ in range(2)]
    cut = [rng.randrange(1, 380) for _ in range(60)]

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

            async def one(prompt):
                sampling = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
                r = await http.post("/generate", json={"input_ids": prompt, "sampling_params": sampling})
                assert r.status_code == 200, r.text
                return prompt + r.json()["output_ids"], False

            async def cut_off():
                body = {
                    "input_ids": cut,
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                }
                async with http.stream("POST", "/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        output = json.loads(line[5:])["output_ids"] if line.startswith("data:") else []
                        if len(output) >= 2 * PAGE:
                            break  # leaving the block closes the connection: the server aborts the request
                return cut + output, True

            done = await asyncio.gather(*(one(p) for p in prompts))
            # Alone and last: when the abort comes before it finishes, its decoded pages go into the cache with the
            # abort, and no step follows (test_an_abort_publishes_the_pages_it_cached_at_once holds this exactly).
            return done + [await cut_off()]

    return asyncio.run(scenario())


def test_an_address_in_use_is_refused_naming_it_and_frees_the_other_socket(folder):
    from fastqwen.engine.llm_engine import LLMEngine

    pub, replay = free_port(), free_port()
    context = zmq.Context()
    taken = context.socket(zmq.ROUTER)
    taken.bind(f"tcp://127.0.0.1:{replay}")
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    try:
        with pytest.raises(RuntimeError, match=f"replay_endpoint: cannot bind tcp://127.0.0.1:{replay}: Address"):
            LLMEngine(folder, dtype="float32", device="cpu", num_pages=8, kv_events_config=events)
        again = context.socket(zmq.PUB)
        again.bind(f"tcp://*:{pub}")  # the PUB socket it had bound was closed
        again.close(linger=0)
    finally:
        taken.close(linger=0)
        context.term()


def test_events_need_the_prefix_cache():
    with pytest.raises(ConfigError, match="prefix cache is off"):
        EngineConfig(model="m", enable_prefix_caching=False, kv_events_config='{"enable_kv_cache_events": true}')


class RecordingPublisher:
    def __init__(self):
        self.batches = []

    def publish(self, records):
        self.batches.append(records)

    def close(self):
        pass


def test_an_abort_publishes_the_pages_it_cached_at_once(folder):
    """An aborted request's decoded pages go into the cache with the abort, between steps; they are handed to the
    publisher then, not with a next step that may not come for a long time (an idle server steps no more).

    Mutation check (run once, not committed): LLMEngine.abort not publishing fails this test."""
    from fastqwen.engine.llm_engine import LLMEngine
    from fastqwen.engine.messages import EngineRequest

    events = {"enable_kv_cache_events": True, "endpoint": "inproc://kv-events-abort"}  # (no port taken)
    engine = LLMEngine(folder, dtype="float32", device="cpu", num_pages=32, page_size=4, kv_events_config=events)
    engine.kv_events.close()
    engine.kv_events = recorder = RecordingPublisher()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True).with_defaults(GenerationDefaults())
    engine.add(EngineRequest(1, [5, 6, 7, 8, 9, 10], params, time.monotonic()))

    def decoded() -> int:
        running = engine.scheduler.running
        return running[0].num_output_tokens if running else 0

    while decoded() < 8:
        engine.step()
    stored = sum(len(r.hashes) for batch in recorder.batches for r in batch if isinstance(r, PagesStored))
    assert stored == 1  # the prompt's whole page, cached once prefilled
    recorder.batches.clear()
    engine.abort(1)
    (batch,) = recorder.batches
    assert [len(r.hashes) for r in batch] == [2] and engine.cache.num_pages == 3  # 13 tokens computed
    engine.close()


def test_a_subscriber_rebuilds_exactly_the_servers_cached_pages(folder):
    """The engine core in its own process, the PUB socket connecting to the subscriber's bound SUB (vLLM's rule for
    an address without a wildcard): after a mixed workload with evictions, splits and an abort, the pages rebuilt
    from the stream are as many as the server's cache holds, each a prefix the server computed.

    Mutation check (run once, not committed): not recording PagesRemoved in RadixCache.evict fails this test (the
    rebuilt set keeps evicted pages)."""
    pub, replay = free_port(), free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", bind_pub=True)
    server = start_server(
        folder, {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    )
    try:
        sequences = subscriber.go_live(server) + workload(server, seed=1)
        cached = subscriber.agree_with(server)
        check_contents(subscriber.rebuilt, sequences)
        assert subscriber.rebuilt.removed > 0, "the workload was meant to force evictions"
        assert 0 < cached <= 24
    finally:
        server.stop()
        subscriber.close()


def test_a_late_subscriber_catches_up_through_the_replay_socket(folder):
    """The engine in a thread of the server process (--engine-core thread), the PUB socket bound: a subscriber that
    joins after a first workload rebuilds everything from the replay socket, then follows the live stream through a
    second workload, and agrees with the server's cache after each.

    Mutation check (run once, not committed): a replay that starts one batch after the sequence asked for fails this
    test."""
    pub, replay = free_port(), free_port()
    server = start_server(
        folder,
        {"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"},
        "--engine-core",
        "thread",
    )
    late = None
    try:
        first = workload(server, seed=2)
        late = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        late.catch_up()
        assert late.next_sequence > 1 and late.replayed == late.next_sequence
        late.agree_with(server)
        check_contents(late.rebuilt, first)
        second = late.go_live(server) + workload(server, seed=3)
        late.agree_with(server)
        check_contents(late.rebuilt, first + second)
        assert late.live > 1
    finally:
        server.stop()
        if late is not None:
            late.close()


def test_under_tensor_parallelism_rank_0_alone_publishes(folder):
    """Two ranks on the CPU, the PUB socket bound to a TCP port (a second rank binding it too would fail the start):
    the pages rebuilt from the replay socket are those of rank 0's tree, walked.

    Mutation check (run once, not committed): every rank starting a publisher fails this test (rank 1 cannot bind)."""
    from fastqwen import LLM
    from fastqwen import SamplingParams as Params

    pub, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": TOPIC,
    }
    llm = LLM(
        folder,
        dtype="float32",
        device="cpu",
        num_pages=64,
        page_size=PAGE,
        tensor_parallel_size=2,
        kv_events_config=events,
    )
    subscriber = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        prompts = [[3 + i] * 40 + list(range(1, 12 + 5 * i)) for i in range(3)]
        llm.generate(prompts, Params(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        deadline = time.monotonic() + 10
        while len(subscriber.rebuilt.pages) != llm.engine.cache.num_pages and time.monotonic() < deadline:
            subscriber.catch_up()
        assert subscriber.rebuilt.prefixes() == tree_prefixes(llm.engine.cache) != set()
    finally:
        subscriber.close()
        llm.close()
