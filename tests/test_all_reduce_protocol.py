"""The custom all-reduce's synchronisation rules (csrc/custom_all_reduce.cu), played out on the CPU: ranks as
generators that take one shared-memory step at a time (a store, a load, a flag), interleaved at random, over calls of
the three kinds and of changing sizes. Every call of every rank must end with the exact sum (integers), and no
interleaving may leave every rank waiting. This checks the rules, not the CUDA code: one barrier a call with the data
copied into alternate halves, two barriers into one half, and the barrier-free calls over three receive buffers that
each call empties one call after their use. Each rule's deliberate break (one half and one barrier, no emptying,
flags compared for equality) fails it, as the tests at the bottom show."""

from __future__ import annotations

import random

import pytest

EMPTY = None  # an empty receive slot


class Shared:
    """Every rank's buffer as the kernels see it (one block: the rules are per block)."""

    def __init__(self, world: int, capacity: int):
        self.world = world
        self.data = [[[0] * capacity for _ in range(2)] for _ in range(world)]  # [rank][half][i]
        self.receive = [[[[EMPTY] * capacity for _ in range(world)] for _ in range(3)] for _ in range(world)]
        self.start = [[0] * world for _ in range(world)]  # start[r][p]: p's flag in r's signal area
        self.end = [[0] * world for _ in range(world)]
        self.round = [0] * world
        self.third = [0] * world
        self.received = [[0] * 3 for _ in range(world)]


def rank_program(s: Shared, r: int, calls, results, rules):
    """Rank r's calls one after another (a stream: a call starts once the one before ended); yields before each
    shared-memory step, and "wait" while a flag or a slot it needs is not there yet."""
    world = s.world
    for kind, inputs in calls:
        n = len(inputs[r])
        k = s.round[r] + 1
        b = (s.third[r] + 1) % 3
        previous = (b + 2) % 3  # empty what the call before stored here (both kinds)
        if rules["empty"]:
            for p in range(world):
                for i in range(s.received[r][previous]):
                    if p != r:
                        yield
                        s.receive[r][previous][p][i] = EMPTY
        total = []
        if kind == "lamport":
            for i in range(n):
                for p in range(world):
                    if p != r:
                        yield
                        s.receive[p][b][r][i] = inputs[r][i]
            for i in range(n):
                acc = 0
                for p in range(world):
                    if p == r:
                        acc += inputs[r][i]
                        continue
                    while s.receive[r][b][p][i] is EMPTY:
                        yield "wait"
                    yield
                    acc += s.receive[r][b][p][i]
                total.append(acc)
            s.received[r][b] = n
        else:
            end_barrier = kind == "two_barriers"
            half = 0 if end_barrier or not rules["halves"] else k % 2
            for i in range(n):
                yield
                s.data[r][half][i] = inputs[r][i]
            yield from barrier(s, r, s.start, k, rules)
            for i in range(n):
                acc = 0
                for p in range(world):
                    yield
                    acc += s.data[p][half][i]
                total.append(acc)
            if end_barrier:
                yield from barrier(s, r, s.end, k, rules)
            s.received[r][b] = 0
        s.round[r], s.third[r] = k, b
        results[r].append(total)


def barrier(s: Shared, r: int, flags, k: int, rules):
    for p in range(s.world):
        yield
        flags[p][r] = k
    for p in range(s.world):
        while not (flags[r][p] == k if rules["equal_flags"] else flags[r][p] >= k):
            yield "wait"


def play(seed: int, rules: dict, world: int = 2, calls: int = 12) -> None:
    """One random interleaving of `calls` calls of random kinds and sizes; AssertionError on a wrong sum or when
    every rank waits."""
    rng = random.Random(seed)
    capacity = 6
    kinds = rules["kinds"]
    plan = []
    for c in range(calls):
        n = rng.randint(1, capacity)
        plan.append((rng.choice(kinds), [[rng.randint(0, 9) + 10 * c for _ in range(n)] for _ in range(world)]))
    s = Shared(world, capacity)
    results = [[] for _ in range(world)]
    programs = [rank_program(s, r, plan, results, rules) for r in range(world)]
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
        assert waiting_in_a_row < 200, f"seed {seed}: every rank waits (deadlock)"
    for r in range(world):
        for c, (kind, inputs) in enumerate(plan):
            want = [sum(inputs[p][i] for p in range(world)) for i in range(len(inputs[0]))]
            assert results[r][c] == want, f"seed {seed}: rank {r}, call {c} ({kind}): {results[r][c]} != {want}"


KEPT = {"halves": True, "empty": True, "equal_flags": False}


# The kinds of call one engine mixes: one barrier and barrier-free (FASTQWEN_ALLREDUCE_LAMPORT=1, small messages), or
# two barriers alone (FASTQWEN_ALLREDUCE_END_BARRIER=1 turns the barrier-free kernels off).
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kinds", [["one_barrier"], ["lamport"], ["one_barrier", "lamport"], ["two_barriers"]])
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
        ({}, ["one_barrier", "two_barriers"]),  # the end barrier switched between calls (custom_all_reduce.h)
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
