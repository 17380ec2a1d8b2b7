"""No client can take the server's connections from the others (issue 40, items 6 and 9), on the real server.

The server runs with a small cap (--max-connections 14, 6 of them reserved, 4 per client address) so each attack is
a dozen sockets. Other client addresses come from 127.0.0.0/8 (every address there is the local host on Linux).
An attacker's connection sends a complete request head and then its body slowly (slowloris), fast enough to meet
--min-body-rate, so the server may not drop it for being slow: only the per-address share and the reserve keep
room for the others. A body slower than the rate gets a 408, and a request head past the size or line limit a 431.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest
from checkpoints import make_checkpoint
from server_process import ServerProcess

MAX_CONNECTIONS, RESERVED, PER_PEER = 14, 6, 4
HEADER_TIMEOUT, MIN_BODY_RATE = 2.0, 100.0
COMPLETION = {"prompt": "t1 t2", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("connection-limits")
    make_checkpoint(str(folder), tied=False, seed=7)
    srv = ServerProcess(
        str(folder),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-pages",
        "256",
        "--page-size",
        "8",
        "--skip-warmup",
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--reserved-connections",
        str(RESERVED),
        "--max-connections-per-peer",
        str(PER_PEER),
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        "30",
        "--min-body-rate",
        str(MIN_BODY_RATE),
    )
    yield srv
    srv.stop()


def client_from(source: str) -> httpx.Client:
    """A client whose connections come from `source`; a new connection for each request, as a fresh client's."""
    transport = httpx.HTTPTransport(local_address=source, limits=httpx.Limits(max_keepalive_connections=0))
    return httpx.Client(transport=transport, timeout=10)


def connect(server, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))


def slow_request_head(length: int = 1_000_000) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: %d\r\n\r\n{"prompt": "' % length
    )


def answer(s: socket.socket, limit: float = 5.0) -> bytes:
    """What the server sends before it closes the connection (or `limit` seconds pass)."""
    s.settimeout(limit)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


class SlowClients:
    """Connections from one address, each sending a request head and then a body that never ends, 20 bytes every
    0.1 s (200 bytes/s, above the server's minimum rate). The connections the server refuses are answered at once;
    `held` are the ones it kept."""

    def __init__(self, server, source: str, count: int):
        self.sockets = [connect(server, source) for _ in range(count)]
        for s in self.sockets:
            s.sendall(slow_request_head())
        self.held, self.refused = list(self.sockets), []
        self._stop = threading.Event()
        self._feeder = threading.Thread(target=self._feed, daemon=True)
        self._feeder.start()

    def settle(self, expected_held: int, limit: float = 10.0) -> None:
        """Wait until every connection beyond `expected_held` has its refusal (or `limit` seconds pass)."""
        deadline = time.monotonic() + limit
        while len(self.held) > expected_held and time.monotonic() < deadline:
            ready, _, _ = select.select(self.held, [], [], 0.1)
            for s in ready:  # answer() reads up to the server's FIN, which comes after it released the slot
                self.held.remove(s)
                self.refused.append(status_of(answer(s)))

    def _feed(self) -> None:
        while not self._stop.wait(0.1):
            for s in list(self.held):
                try:
                    s.sendall(b" " * 20)
                except OSError:
                    pass

    def still_open(self) -> int:
        """How many held connections the server has not answered or closed."""
        ready, _, _ = select.select(self.held, [], [], 0)
        return len(self.held) - len(ready)

    def close(self) -> None:
        """Close every connection and wait until the server has let go of each (its FIN comes after the slot is
        released), so the next test starts with the slots free."""
        self._stop.set()
        self._feeder.join()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_WR)
                answer(s)
            except OSError:
                pass
            s.close()


def test_a_peer_holding_its_share_cannot_keep_out_another_peer_or_the_health_probe(server):
    attacker = SlowClients(server, "127.0.0.1", MAX_CONNECTIONS + 2)
    try:
        attacker.settle(PER_PEER)
        assert len(attacker.held) == PER_PEER, f"one address holds {len(attacker.held)} connections"
        assert set(attacker.refused) == {429}, attacker.refused
        with client_from("127.0.0.2") as other:
            assert other.post(server.url + "/v1/completions", json=COMPLETION).status_code == 200
            assert other.get(server.url + "/health").status_code == 200
        with client_from("127.0.0.1") as same:  # the reserve answers /health even from the attacker's address
            assert same.get(server.url + "/health").status_code == 200
            refused = same.post(server.url + "/v1/completions", json=COMPLETION)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == 429, refused.text
            assert "too many connections" in refused.json()["error"]["message"]
        assert attacker.still_open() == PER_PEER, "the attack must have lasted through the checks"
    finally:
        attacker.close()


def test_peers_holding_every_general_slot_leave_the_reserve_to_newcomers(server):
    # Four addresses at their share would hold all 14 slots (4 x 4 = 16) without the reserve. With it, two fill the
    # 8 general slots and the other two get 2 reserved each (they are fresh until they hold 2): 2 stay free.
    attackers = [SlowClients(server, f"127.0.0.{3 + i}", PER_PEER) for i in range(4)]
    try:
        for attacker, expected in zip(attackers, [PER_PEER, PER_PEER, 2, 2]):
            attacker.settle(expected)
        held = [len(a.held) for a in attackers]
        assert held == [PER_PEER, PER_PEER, 2, 2], held
        assert set(attackers[2].refused + attackers[3].refused) == {503}
        with client_from("127.0.0.2") as newcomer:
            for _ in range(3):
                assert newcomer.post(server.url + "/v1/completions", json=COMPLETION).status_code == 200
            assert newcomer.get(server.url + "/health").status_code == 200
        assert sum(a.still_open() for a in attackers) == sum(held), "the attack must have lasted through the checks"
    finally:
        for attacker in attackers:
            attacker.close()


def test_a_reopening_flood_leaves_other_clients_served(server):
    """One address opens connections as fast as the server closes them, for as long as another client sends 12
    requests (each on a new connection): every one of those is served."""
    stop, opened = threading.Event(), [0]

    def flood() -> None:
        live: list[socket.socket] = []
        while not stop.is_set():
            while len(live) < MAX_CONNECTIONS + 4:
                s = connect(server, "127.0.0.8")
                s.sendall(slow_request_head())
                live.append(s)
                opened[0] += 1
            ready, _, _ = select.select(live, [], [], 0.05)  # answered (refused) or closed: open another
            for s in ready:
                live.remove(s)
                s.close()
            for s in live:
                try:
                    s.sendall(b" " * 10)
                except OSError:  # refused and reset: select reports it next round
                    pass
        for s in live:
            s.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        with client_from("127.0.0.9") as other:
            statuses = [other.post(server.url + "/v1/completions", json=COMPLETION).status_code for _ in range(12)]
    finally:
        stop.set()
        flooder.join()
    assert statuses == [200] * 12, statuses
    assert opened[0] > 2 * MAX_CONNECTIONS, f"the flood opened only {opened[0]} connections"


def test_a_body_slower_than_the_minimum_rate_gets_408(server):
    """Bodies get --header-timeout seconds (2) plus one second per --min-body-rate bytes (100) that came: one sent
    at 10 bytes/s is cut off after about 2.2 s; one sent at 300 bytes/s, for 3 s, is served."""
    body = (json.dumps(COMPLETION)[:-1] + " " * 800 + "}").encode()  # JSON whitespace makes it long
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    slow, steady = connect(server, "127.0.0.10"), connect(server, "127.0.0.11")
    slow.sendall(head % 1000)
    steady.sendall(head % len(body))
    started, sent, slow_answer = time.monotonic(), 0, None
    try:
        while sent < len(body):
            steady.sendall(body[sent : sent + 30])
            sent += 30
            if slow_answer is None:
                if select.select([slow], [], [], 0)[0]:
                    slow_answer, slow_after = answer(slow), time.monotonic() - started
                else:
                    slow.sendall(b" ")
            time.sleep(0.1)  # the pace of the two bodies
        steady_answer, steady_after = answer(steady, 10), time.monotonic() - started
        if slow_answer is None:
            slow_answer, slow_after = answer(slow, 3), time.monotonic() - started
    finally:
        slow.close()
        steady.close()
    assert status_of(slow_answer) == 408, slow_answer
    assert "too slowly" in json.loads(slow_answer.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert slow_after < 4.0, f"the slow body was cut off after {slow_after:.1f} s (--body-timeout is 30 s)"
    assert status_of(steady_answer) == 200, steady_answer
    assert steady_after > HEADER_TIMEOUT, "the steady body must outlast the grace, or the rate was never tested"


OVERSIZED_HEADS = {
    "100 KB header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
    "5,000 headers": b"GET /health HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-%d: y\r\n" % i for i in range(5000))
    + b"\r\n",
}


@pytest.mark.parametrize("name", OVERSIZED_HEADS)
def test_an_oversized_request_head_in_one_write_gets_431(server, name):
    head = OVERSIZED_HEADS[name]
    s = connect(server, "127.0.0.12")
    try:
        s.sendall(head)  # all in one write: h11's bound on an incomplete head never applies
        response = answer(s)  # the server closes the connection after its answer
    finally:
        s.close()
    assert status_of(response) == 431, response[:200]
    assert json.loads(response.partition(b"\r\n\r\n")[2])["error"]["code"] == 431
    with client_from("127.0.0.12") as client:  # the same client's next request is served
        assert client.get(server.url + "/health").status_code == 200


def test_a_head_within_the_limits_is_served(server):
    headers = {f"x-{i}": "v" * 100 for i in range(90)}  # 90 lines, about 10 KB: under 100 lines and 16 KiB
    with client_from("127.0.0.12") as client:
        assert client.get(server.url + "/health", headers=headers).status_code == 200


def test_slot_accounting_matches_a_recount_over_random_opens_and_closes():
    """ConnectionSlots keeps counters; a reference decides each admission by recounting the open connections."""
    import random

    from fastqwen.server.connections import GENERAL, HEALTH_ONLY, RESERVED, ConnectionLimits, ConnectionSlots, Refusal

    limits = ConnectionLimits(max_connections=20, reserved_connections=6, max_connections_per_peer=5)
    slots, open_ = ConnectionSlots(limits), []  # open_: (peer, kind) of every admitted connection
    rng = random.Random(3)
    for _ in range(5000):
        if open_ and rng.random() < 0.45:
            slots.release(*open_.pop(rng.randrange(len(open_))))
            continue
        peer = f"10.0.0.{rng.randrange(6)}"
        mine = [kind for p, kind in open_ if p == peer]
        if len(open_) >= 20:
            expected = 503
        elif len(mine) < 5 and len(open_) < 14:
            expected = GENERAL
        elif len(mine) < 2:
            expected = RESERVED
        elif HEALTH_ONLY not in mine:
            expected = HEALTH_ONLY
        else:
            expected = 429 if len(mine) >= 5 else 503
        got = slots.admit(peer)
        assert (got.status if isinstance(got, Refusal) else got) == expected, (peer, mine, len(open_))
        if not isinstance(got, Refusal):
            open_.append((peer, got))
    for connection in open_:
        slots.release(*connection)
    assert slots.open == 0 and slots.held == {} and slots.health_only == set()


def test_by_default_one_address_may_use_every_general_slot():
    """A gateway or a load generator sends every request from one address: by default it may hold all the general
    slots (the 1/16 reserved still admit newcomers), so 512 streams from loopback are not refused past 256."""
    from fastqwen.serve import parse_args
    from fastqwen.server.connections import GENERAL, RESERVED, ConnectionLimits, ConnectionSlots

    args = parse_args(["--model", "m"])
    assert (args.max_connections, args.reserved_connections, args.max_connections_per_peer) == (2048, 128, 1920)
    assert parse_args(["--model", "m", "--max-connections", "160"]).max_connections_per_peer == 150
    assert parse_args(["--model", "m", "--max-connections-per-peer", "7"]).max_connections_per_peer == 7
    limits = ConnectionLimits(
        max_connections=args.max_connections,
        reserved_connections=args.reserved_connections,
        max_connections_per_peer=args.max_connections_per_peer,
    )
    slots = ConnectionSlots(limits)
    assert {slots.admit("127.0.0.1") for _ in range(1920)} == {GENERAL}
    assert slots.admit("127.0.0.1") not in (GENERAL, RESERVED)  # the reserve stays for others (and /health)
    assert slots.admit("10.0.0.9") == RESERVED


def test_a_kept_alive_connection_gets_its_first_event_without_waiting_for_an_ack(server):
    """The server's connections send without Nagle's delay: on a kept-alive connection a stream's first event came
    about 40 ms after its response headers (held until the client's delayed ACK of the headers) while the listening
    socket was made without naming TCP, so that asyncio left TCP_NODELAY off. The gap measured here also holds the
    tiny CPU model's first step (a few ms)."""
    body = json.dumps({**COMPLETION, "max_tokens": 1, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    )
    gaps = []
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        for _ in range(6):
            s.sendall(request % (len(body), body))
            received, head_at, event_at = b"", None, None
            while not received.endswith(b"\r\n0\r\n\r\n"):
                chunk = s.recv(65536)
                assert chunk, "the server closed the connection"
                now, received = time.perf_counter(), received + chunk
                head_at = head_at or (now if b"\r\n\r\n" in received else None)
                event_at = event_at or (now if b"data: {" in received else None)
            assert received.startswith(b"HTTP/1.1 200"), received[:80]
            gaps.append(event_at - head_at)
    kept_alive = sorted(gaps[1:])  # (the first request's connection was new: no delayed ACK there)
    assert kept_alive[len(kept_alive) // 2] < 0.02, [round(g * 1e3, 1) for g in gaps]


def test_the_listening_socket_is_made_for_tcp():
    """What the server's connections inherit: asyncio sets TCP_NODELAY on a connection only when its socket's proto
    is IPPROTO_TCP (an accepted connection here, as through uvicorn)."""
    import asyncio

    from fastqwen.serve import _bind

    listener = _bind("127.0.0.1", 0)
    listener.listen()

    async def accept_one() -> int:
        accepted = asyncio.get_running_loop().create_future()

        def on_connection(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        nodelay = await asyncio.wait_for(accepted, 10)
        writer.close()
        server.close()
        return nodelay

    try:
        assert listener.proto == socket.IPPROTO_TCP
        assert asyncio.run(accept_one()) != 0
    finally:
        listener.close()
