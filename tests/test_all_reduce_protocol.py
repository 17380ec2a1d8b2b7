"""The custom all-reduce's synchronisation rules (csrc/custom_all_reduce.cu), played out on the CPU: each rank's
kernel blocks as generators that take one shared-memory step at a time (a store, a load, a flag), interleaved at
random, over calls of the three kinds, of changing sizes and of changing grids (block b takes elements b, b + grid,
...). Every call of every rank must end with the exact sum (integers), and no interleaving may leave every block
waiting. This checks the rules, not the CUDA code: one barrier a call with the data copied into alternate halves, two
barriers into one half, the barrier-free calls over three receive buffers that each call empties one call after their
use, and the round counters every launch sets for every block (block 0 those of the blocks it did not launch); and the
barrier-free calls whose message a GEMV sent before them (kGemvSend: a kernel of its own grid that stores each element
into its slot of every rank's buffer of the coming round, its own rank's too, after which the all-reduce only waits
and sums). Each rule's deliberate break fails it, as the tests at the bottom show."""

from __future__ import annotations

import random

import pytest

EMPTY = None  # an empty receive slot
MAX_BLOCKS = 3


class Shared:
    """Every rank's buffer as the kernels see it."""

    def __init__(self, world: int, capacity: int):
        self.world = world
        self.data = [[[0] * capacity for _ in range(2)] for _ in range(world)]  # [rank][half][i]
        self.receive = [[[[EMPTY] * capacity for _ in range(world)] for _ in range(3)] for _ in range(world)]
        # start[r][b][p]: the flag block b of rank p stored in r's signal area
        self.start = [[[0] * world for _ in range(MAX_BLOCKS)] for _ in range(world)]
        self.end = [[[0] * world for _ in range(MAX_BLOCKS)] for _ in range(world)]
        self.round = [[0] * MAX_BLOCKS for _ in range(world)]
        self.third = [[0] * MAX_BLOCKS for _ in range(world)]
        self.received = [[0] * 3 for _ in range(world)]


def block_program(s: Shared, r: int, b: int, grid: int, kind: str, inputs, total: list, rules, gemv_done=None):
    """Block b of rank r's kernel for one call: yields before each shared-memory step, "wait" while a flag or a slot
    it needs is not there yet. kind "sent": gemv_done() says whether every block of the rank's sending GEMV has ended
    (the kernel's wait), which only the read of the rank's own slot waits for."""
    world, n = s.world, len(inputs[r])
    mine = range(b, n, grid)  # this block's elements
    k = s.round[r][b] + 1
    third = (s.third[r][b] + 1) % 3
    previous = (third + 2) % 3  # empty what the call before stored here (every block a share, both kinds)
    if rules["empty"]:
        for p in range(world):
            for i in range(b, s.received[r][previous], grid):
                if p != r:
                    yield
                    s.receive[r][previous][p][i] = EMPTY
    if kind in ("lamport", "sent"):
        if kind == "lamport":  # ("sent": the GEMV before stored every slot, this rank's own too)
            for i in mine:
                for p in range(world):
                    if p != r:
                        yield
                        s.receive[p][third][r][i] = inputs[r][i]
        if kind == "sent":  # the peers' rows while the GEMV may still run, then the wait for it
            for i in mine:
                for p in range(world):
                    while p != r and s.receive[r][third][p][i] is EMPTY:
                        yield "wait"
            while rules["own_after_gemv"] and not gemv_done():
                yield "wait"
        for i in mine:
            acc = 0
            for p in range(world):
                if p == r and kind == "lamport":
                    acc += inputs[r][i]
                    continue
                while s.receive[r][third][p][i] is EMPTY:
                    yield "wait"
                yield
                acc += s.receive[r][third][p][i]
            total[i] = acc
    else:
        end_barrier = kind == "two_barriers"
        half = 0 if end_barrier or not rules["halves"] else k % 2
        for i in mine:
            yield
            s.data[r][half][i] = inputs[r][i]
        yield from barrier(s, r, b, s.start, k, rules)
        for i in mine:
            acc = 0
            for p in range(world):
                yield
                acc += s.data[p][half][i]
            total[i] = acc
        if end_barrier:
            yield from barrier(s, r, b, s.end, k, rules)
    # end_round (and record_sent, block 0)
    s.round[r][b], s.third[r][b] = k, third
    if b == 0:
        s.received[r][third] = n if kind in ("lamport", "sent") else 0
        if rules["absent_counters"]:
            for absent in range(grid, MAX_BLOCKS):
                s.round[r][absent], s.third[r][absent] = k, third


def sending_gemv(s: Shared, r: int, b: int, grid: int, inputs, rules):
    """Block b of rank r's sending GEMV (its own grid, blocks of consecutive outputs): each output into its slot of
    every rank's buffer of the coming round, the one after the rank's record of the last round's (block 0's)."""
    world, n = s.world, len(inputs[r])
    third = (s.third[r][0] + (1 if rules["send_next"] else 0)) % 3
    per_block = -(-n // grid)
    for i in range(b * per_block, min(n, (b + 1) * per_block)):
        for p in range(world):
            yield
            s.receive[p][third][r][i] = inputs[r][i]


def barrier(s: Shared, r: int, b: int, flags, k: int, rules):
    for p in range(s.world):
        yield
        flags[p][b][r] = k
    for p in range(s.world):
        while not (flags[r][b][p] == k if rules["equal_flags"] else flags[r][b][p] >= k):
            yield "wait"


def rank_program(s: Shared, r: int, calls, results, rules, rng: random.Random):
    """Rank r's calls one after another (a stream: a call starts once every block of the one before ended), the blocks
    of a call interleaved at random."""
    for kind, grid, inputs in calls:
        total = [None] * len(inputs[r])
        blocks = []
        if kind == "sent":  # the GEMV's blocks, and beside them the all-reduce's (which starts early: PDL)
            gemv_grid = rng.randint(1, 4)
            blocks = [sending_gemv(s, r, b, gemv_grid, inputs, rules) for b in range(gemv_grid)]
        gemv = list(blocks)
        done = lambda gemv=gemv, blocks=blocks: not any(g in blocks for g in gemv)  # noqa: E731
        blocks += [block_program(s, r, b, grid, kind, inputs, total, rules, done) for b in range(grid)]
        while blocks:
            block = rng.choice(blocks)
            try:
                yield next(block)
            except StopIteration:
                blocks.remove(block)
        results[r].append(total)


def play(seed: int, rules: dict, world: int = 2, calls: int = 12) -> None:
    """One random interleaving of `calls` calls of random kinds, sizes and grids; AssertionError on a wrong sum or
    when every rank waits."""
    rng = random.Random(seed)
    capacity = 6
    plan = []
    for c in range(calls):
        n = rng.randint(1, capacity)
        grid = rng.randint(1, MAX_BLOCKS) if rules["grids"] else 1
        inputs = [[rng.randint(0, 9) + 10 * c for _ in range(n)] for _ in range(world)]
        plan.append((rng.choice(rules["kinds"]), grid, inputs))
    s = Shared(world, capacity)
    results = [[] for _ in range(world)]
    programs = [rank_program(s, r, plan, results, rules, random.Random(seed * 31 + r)) for r in range(world)]
    running = list(range(world))
    waiting_in_a_row = 0
    while running:
        r = rng.choice(running)
        try:
            step = next(programs[r])
        except StopIteration:
            running.remove(r)
            continue
        waiting_in_a_row = waiting_in_a_row + 1 if step == "wait" else 0
        assert waiting_in_a_row < 400, f"seed {seed}: every block waits (deadlock)"
    for r in range(world):
        for c, (kind, grid, inputs) in enumerate(plan):
            want = [sum(inputs[p][i] for p in range(world)) for i in range(len(inputs[0]))]
            assert results[r][c] == want, f"seed {seed}: rank {r}, call {c} ({kind}, grid {grid}): {results[r][c]}"


KEPT = {
    "halves": True,
    "empty": True,
    "equal_flags": False,
    "absent_counters": True,
    "grids": True,
    "send_next": True,
    "own_after_gemv": True,
}


# The kinds of call one engine mixes: barrier-free (small messages, the default) and one barrier, with sending GEMVs
# (FASTQWEN_GEMV_SENDS=1) before some barrier-free ones, or two barriers alone (FASTQWEN_ALLREDUCE_END_BARRIER=1 turns
# the barrier-free kernels off).
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    "kinds",
    [["one_barrier"], ["lamport"], ["one_barrier", "lamport"], ["sent", "lamport", "one_barrier"], ["two_barriers"]],
)
def test_every_interleaving_sums_exactly(world, kinds):
    for seed in range(150):
        play(seed, {**KEPT, "kinds": kinds}, world)


@pytest.mark.parametrize(
    "broken, kinds",
    [
        ({"halves": False}, ["one_barrier"]),  # one half, one barrier: a copy overwrites what a peer still reads
        ({"empty": False}, ["lamport"]),  # a slot still full from three calls before is taken for this call's
        ({"empty": False}, ["one_barrier", "lamport"]),
        ({"equal_flags": True}, ["one_barrier"]),  # a peer a call ahead has replaced the flag waited for
        ({"absent_counters": False}, ["one_barrier"]),  # a block's counter behind: its half and flags are a call off
        ({"absent_counters": False}, ["lamport"]),  # ... and its receive buffer
        ({}, ["one_barrier", "two_barriers"]),  # the end barrier switched between calls (custom_all_reduce.h)
        ({"send_next": False}, ["sent", "lamport"]),  # the GEMV sends into the last call's buffer
        ({"empty": False}, ["sent"]),  # nothing emptied: a sent call sums a peer's row of three calls before
        ({"own_after_gemv": False}, ["sent"]),  # its own row read before its GEMV ended: one of three calls before
    ],
)
def test_each_broken_rule_is_caught(broken, kinds):
    failures = 0
    for seed in range(150):
        try:
            play(seed, {**KEPT, **broken, "kinds": kinds})
        except AssertionError:
            failures += 1
    assert failures > 0, f"no interleaving of 150 broke {broken}"
