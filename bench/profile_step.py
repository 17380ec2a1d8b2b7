"""Where the time of a decode step goes: the host time of each part of LLMEngine.step, next to the GPU time of the
step's work (a CUDA-event timed replay of the same decode graph, sampler included).

    python bench/profile_step.py --model Qwen3-8B --load-format dummy [--batch N] [--disable-overlap-schedule] [--verify]
                                 [--disable-cuda-graph] [--json out]

Parts (milliseconds of host time per engine.step call, means over the decode steps, so that they add up to the
mean step call; step_ms and engine_step_call_ms are medians):
  schedule     Scheduler.schedule (a step that was not launched ahead) and Scheduler.schedule_ahead
  launch       ModelRunner.launch: fill the pinned buffers, enqueue the upload, the replay and the token copy
  collect      ModelRunner.collect: wait for the tokens; this is where the host waits for the GPU
  replay       ModelRunner.launch_replay called by the engine itself (a verify step launched before step() returns:
               fill the pinned buffers, the upload, the replay, the token copy)
  record       Scheduler.update: the step's tokens, accepted drafts, stop checks, detokenization
  update       the rest: building the step's updates and what the engine does between the parts above
A verify step's drafts follow the step before it: the GPU waits while the host runs record, schedule (the drafts)
and replay, so their sum is the idle time a speculative step adds to the GPU's. With an EAGLE-3 head (drafts made on
the GPU), drafter_ms splits out its advance over the kept tokens and its draft steps (each inside one of the parts
above), with their waits for the GPU.
With overlap the GPU runs step N+1 while the host records step N: the step time approaches gpu_ms when the host
parts other than collect add up to less than gpu_ms. Without it, step time = host parts + gpu_ms.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
from common import add_decode_attention_options, apply_decode_attention_options, report
from fastqwen import LLM, SamplingParams
from fastqwen.config import EngineConfig


def timed(store: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store.setdefault(name, []).append(time.perf_counter() - start)

    return wrapper


def stamped(stamps: list, label: str, fn, at_entry: bool = False):
    """fn, with (label, the time it returned, or was called with at_entry) appended to stamps at each call."""

    def wrapper(*args, **kwargs):
        if at_entry:
            stamps.append((label, time.perf_counter()))
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            stamps.append((label, time.perf_counter()))

    return wrapper


def gate_path(stamps: list, waits_ns: list[int]) -> dict:
    """The host's path from a gated verify step's tokens to the opening of the next step's gate, which the GPU waits
    for (medians over the steps, ms): tokens back (collect returned) -> recorded (Scheduler.update returned) ->
    drafted (the next step scheduled) -> opened; and the GPU's own measure of that wait (the gate kernel's clock,
    from the end of the step before to the opening), whose rest beyond the host's path is the read-back's latency
    and the gate's reaction."""
    parts: dict[str, list[float]] = {"recorded": [], "drafted": [], "opened": [], "tokens_to_open": []}
    start = last = None
    for label, t in stamps:
        if label == "tokens":
            start = last = t
        elif start is not None and label in parts:
            parts[label].append(t - last)
            last = t
            if label == "opened":
                parts["tokens_to_open"].append(t - start)
                start = None
    result = {k: round(statistics.median(v) * 1e3, 4) for k, v in parts.items() if v}
    if waits_ns:
        result["gpu_wait"] = round(statistics.median(waits_ns) / 1e6, 4)
        result["gates"] = len(waits_ns)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_arguments(p, model="Qwen3-8B", load_format="dummy", max_model_len=8192)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="decode batch size (that many requests at once)")
    p.add_argument("--kernels", action="store_true", help="also list the decode graph's kernels (torch.profiler)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="with --speculative-config: with --kernels, the kernels of the timed run's steps (verify steps) as the "
        "profiler saw them, per step, instead of a replay of the decode graph (a verify graph replayed after the run "
        "reads inputs its last step no longer left)",
    )
    add_decode_attention_options(p)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    apply_decode_attention_options(args)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )  # the capture's time and memory
    llm = LLM(EngineConfig.from_cli(args))
    engine = llm.engine
    runner, scheduler = engine.runner, engine.scheduler
    times: dict[str, list[float]] = {}
    scheduler.schedule = timed(times, "schedule", scheduler.schedule)
    scheduler.schedule_ahead = timed(times, "schedule_ahead", scheduler.schedule_ahead)
    runner.collect = timed(times, "collect", runner.collect)
    scheduler.update = timed(times, "record", scheduler.update)
    engine.step = timed(times, "engine_step", engine.step)
    batch_sizes: list[int] = []
    ends: list[float] = []
    launch = runner.launch

    in_launch = [False]  # runner.launch calls launch_replay: its time is launch's, not replay's

    def launch_recording(scheduled, after=None):
        in_launch[0] = True
        try:
            launched = launch(scheduled, after)
        finally:
            in_launch[0] = False
        # A step launched ahead (after=) counts too: under overlap every decode step is; None is one not launched
        # (the engine launches it later by itself). A verify step decodes too: one new token a sequence, its drafts.
        if launched is not None:
            decoding = all(c.end - c.start == 1 for c in scheduled.chunks)
            batch_sizes.append(len(scheduled.chunks) if decoding else -1)
        return launched

    launch_replay = runner.launch_replay

    def launch_replay_recording(scheduled):  # (steps launched ahead: the decode and verify steps under overlap)
        start = time.perf_counter()
        launched = launch_replay(scheduled)
        if not in_launch[0]:
            times.setdefault("replay", []).append(time.perf_counter() - start)
            if launched is not None:
                batch_sizes.append(len(scheduled.chunks))
        return launched

    runner.launch_replay = launch_replay_recording
    # What a verify step's launch spends its host time on (the GPU waits for all of it: the drafts need the tokens)
    replay_parts: dict[str, list[float]] = {}
    if args.verify and runner.verify_graphs is not None:
        runner.sampler.prepare = timed(replay_parts, "sampler_prepare", runner.sampler.prepare)
        runner.staging.wait_uploaded = timed(replay_parts, "wait_uploaded", runner.staging.wait_uploaded)
        runner.staging.host_views = timed(replay_parts, "host_views", runner.staging.host_views)
        runner.staging.upload = timed(replay_parts, "upload", runner.staging.upload)
        runner.verify_graphs.replay = timed(replay_parts, "graph_replay", runner.verify_graphs.replay)
        runner._start_read_back = timed(replay_parts, "read_back", runner._start_read_back)
    # A drafter that works on the GPU (EAGLE-3): its host time advancing the head over the kept tokens (inside update,
    # on a CPU run) and making the drafts (inside schedule: the draft steps and their one read-back), which the GPU
    # waits for before the verify step.
    drafter_parts: dict[str, list[float]] = {}
    drafter = getattr(engine.speculator, "drafter", None) if engine.speculator is not None else None
    if getattr(drafter, "drafts_on_device", False):
        drafter.advance_batch = timed(drafter_parts, "advance", drafter.advance_batch)
        drafter._draft_all = timed(drafter_parts, "draft_steps", drafter._draft_all)
    runner.launch = timed(times, "launch", launch_recording)
    # The critical path of a gated verify step (see gate_path): each stamp when its call returned, the opening when called
    stamps: list[tuple[str, float]] = []
    gate_waits: list[int] = []
    gate = getattr(runner, "_gate", None)
    if args.verify and gate is not None:
        collect = runner.collect

        def collect_stamped(pending):
            out = collect(pending)
            if pending.gate:  # (the gate after it opens only later: the word still holds this one's wait)
                stamps.append(("tokens", time.perf_counter()))
                gate_waits.append(gate.waited_ns())
            return out

        runner.collect = collect_stamped
        scheduler.update = stamped(stamps, "recorded", scheduler.update)
        scheduler.schedule = stamped(stamps, "drafted", scheduler.schedule)
        gate.open = stamped(stamps, "opened", gate.open, at_entry=True)

    prompts = [[(7 * i + 13 * b) % engine.config.vocab_size for i in range(args.prompt_len)] for b in range(args.batch)]
    # Decodes go first in a step, so the sequences prefilled early decode while the rest prefill (a step per chunk of
    # the prompts): their room for that, so that every sequence still has the timed steps' tokens left once all decode
    # together (with the timed steps' tokens only, 512 prompts of 640 tokens never decoded all at once, and the
    # prefill loop spun on an empty engine).
    prefill_steps = -(-args.batch * args.prompt_len // args.max_num_batched_tokens) + 2
    per_step = 1 + (engine.speculator.config.num_speculative_tokens if engine.speculator is not None else 0)
    max_tokens = (args.steps + 1 + prefill_steps) * per_step
    step_profile = None
    for run in range(2):  # the first run warms up
        batch_sizes.clear()
        for prompt in prompts:
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while not batch_sizes or batch_sizes[-1] != args.batch:  # prefill (eager, chunked) until all decode
            if not engine.has_unfinished():
                raise SystemExit(f"profile_step: the {args.batch} sequences never decoded in one step")
            engine.step()
        engine.step()  # (the first decode step's call may still record the prefill's last chunk)
        for values in [*times.values(), *replay_parts.values(), *drafter_parts.values(), stamps, gate_waits]:
            values.clear()  # the decode steps only
        ends.clear()
        if run == 1 and args.verify and args.kernels:
            step_profile = profiled_steps(engine, ends, args.steps)
        first_timed = len(batch_sizes)
        while len(ends) < args.steps and engine.has_unfinished():  # the timed steps: every sequence decodes in each
            engine.step()
            ends.append(time.perf_counter())
        timed_batches = batch_sizes[first_timed:]
        timed_times = {name: list(values) for name, values in times.items()}
        timed_replay_parts = {name: list(values) for name, values in replay_parts.items()}
        timed_drafter_parts = {name: list(values) for name, values in drafter_parts.items()}
        timed_stamps, timed_gate_waits = list(stamps), list(gate_waits)
        while engine.has_unfinished():  # the rest, untimed
            engine.step()
    times, replay_parts, drafter_parts = timed_times, timed_replay_parts, timed_drafter_parts
    stamps, gate_waits = timed_stamps, timed_gate_waits

    def median_ms(name: str) -> float:
        values = times.get(name, [])
        return statistics.median(values) * 1e3 if values else 0.0

    steps = len(times["engine_step"])

    def per_step_ms(*names: str) -> float:
        return sum(sum(times.get(name, [])) for name in names) / steps * 1e3

    # Means per engine.step call, so the parts add up: every timed call runs inside engine.step, so the rest
    # ("update") is the step's total minus its parts and cannot come out negative. (With overlap, a step's launch may
    # be a refused launch ahead plus an ordinary one, and schedule runs only when no step was launched ahead.)
    parts = {
        "schedule": per_step_ms("schedule", "schedule_ahead"),
        "launch": per_step_ms("launch"),
        "replay": per_step_ms("replay"),
        "collect": per_step_ms("collect"),
        "record": per_step_ms("record"),
    }
    parts["update"] = per_step_ms("engine_step") - sum(parts.values())
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    graphs = None if args.verify else runner.graphs
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else str(engine.device),
        "cuda_graph": runner.graphs is not None,
        "overlap": engine.overlap,
        "prompt_tokens": args.prompt_len,
        "batch": args.batch,
        "decode_steps": steps,
        "decode_batch_min": min(timed_batches, default=0),  # the fewest sequences a timed step launched
        "steps_launched_ahead": engine.num_ahead_steps,
        "steps_launched_early": engine.num_early_launches,  # verify steps launched before step() returned
        "step_ms": statistics.median(gaps) * 1e3,  # median time between the ends of consecutive steps
        "engine_step_call_ms": median_ms("engine_step"),  # median duration of one engine.step call
        "engine_step_call_mean_ms": per_step_ms("engine_step"),
        "gpu_ms": graph_replay_ms(graphs, args.batch),
        "host_ms": {k: round(v, 4) for k, v in parts.items()},  # means per engine.step call; they sum to the mean
    }
    if runner.verify_graphs is not None:  # verify steps queued behind the host gate (FASTQWEN_VERIFY_GATE)
        result["verify_gate"] = {
            "gated": runner.num_gated_launches,
            "cancelled": runner.num_gate_cancels,
            "timed_out": runner.num_gate_timeouts,
        }
    if runner.chain is not None:  # verify steps made on the device from the one before (FASTQWEN_VERIFY_CHAIN)
        result["verify_chain"] = {"chained": engine.num_chained_steps, "starts": runner.chain.num_starts}
    if gate_waits:
        result["gate_path_ms"] = gate_path(stamps, gate_waits)
    if replay_parts:  # (means per engine.step call, as the parts above; "replay" holds them)
        result["replay_ms"] = {k: round(sum(v) / steps * 1e3, 4) for k, v in replay_parts.items()}
    if drafter_parts:  # (means per engine.step call, each inside one of the host parts above)
        result["drafter_ms"] = {k: round(sum(v) / steps * 1e3, 4) for k, v in drafter_parts.items()}
    # Host work besides the wait: with overlap it hides behind the GPU as long as it is below gpu_ms.
    result["host_ms_excluding_wait"] = round(sum(v for k, v in parts.items() if k != "collect"), 4)
    if args.kernels and graphs is not None:
        result["kernels"] = graph_kernels(graphs, args.batch)
    if step_profile is not None:
        result["step_kernels"] = step_profile
    report(result, args.json)
    return 0


def profiled_steps(engine, ends: list[float], limit: int) -> dict:
    """Run up to `limit` of the engine's next steps under torch.profiler: per kernel name, calls and GPU time per step,
    and the kernels' busy time per step against the step's wall time (FASTQWEN_PDL=0 for durations that add up)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while len(ends) < limit and engine.has_unfinished():
            engine.step()
            ends.append(time.perf_counter())
        torch.cuda.synchronize()
    steps = max(len(ends), 1)
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.device_time)  # us
    rows = sorted(((name, len(t) / steps, sum(t) / steps) for name, t in by_name.items()), key=lambda r: -r[2])
    for name, calls, us in rows[:30]:
        print(f"{us:9.1f} us  {calls:6.1f} calls  {us / calls:7.2f} us each  {name[:110]}", file=sys.stderr)
    busy = sum(e.device_time for e in events) / steps
    wall = (ends[-1] - ends[0]) / (steps - 1) * 1e6 if steps > 1 else 0.0
    print(f"kernels {len(events) / steps:.0f} per step, busy {busy:.1f} us of a {wall:.1f} us step", file=sys.stderr)
    return {
        "steps": steps,
        "per_step_kernels": len(events) / steps,
        "busy_us_per_step": busy,
        "step_wall_us": wall,
        "by_name": [{"name": n, "calls_per_step": c, "us_per_step": round(u, 2)} for n, c, u in rows],
    }


def graph_replay_ms(graphs, batch: int) -> float | None:
    """Median GPU time of one replay of the graph (decode or verify) that runs `batch` sequences (model, LM head and
    sampler)."""
    if graphs is None or batch > graphs.max_bs:
        return None
    size = graphs.padded_size(batch)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(30):
        begin.record()
        graphs.replay(size)
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end))
    return statistics.median(samples[5:])


def graph_kernels(graphs, batch: int, replays: int = 10) -> dict:
    """The kernels of the graph's replays as the profiler saw them: per kernel name, calls and GPU time per replay;
    and the replay's span against the sum of its kernels (the rest is the gaps between kernels). With programmatic
    dependent launch (FASTQWEN_PDL, on by default) a kernel starts before the one it waits for ends, so the times
    overlap: FASTQWEN_PDL=0 gives durations that add up."""
    from torch.profiler import ProfilerActivity, profile

    size = graphs.padded_size(batch)
    for _ in range(3):
        graphs.replay(size)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.replay(size)
            torch.cuda.synchronize()  # (replays apart: a span is one replay)
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
    events.sort(key=lambda e: e.time_range.start)
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.device_time)  # us
    busy = sum(e.device_time for e in events) / replays
    span = (events[-1].time_range.end - events[0].time_range.start) / replays if events else 0.0
    rows = sorted(((name, len(t) / replays, sum(t) / replays) for name, t in by_name.items()), key=lambda r: -r[2])
    for name, calls, us in rows[:25]:
        print(f"{us:9.1f} us  {calls:6.1f} calls  {us / calls:7.2f} us each  {name[:110]}", file=sys.stderr)
    print(
        f"kernels {len(events) / replays:.0f} per replay, busy {busy:.1f} us of a {span:.1f} us span (the span "
        "includes the host's sync between replays: compare busy with gpu_ms)",
        file=sys.stderr,
    )
    return {
        "per_replay_kernels": len(events) / replays,
        "busy_us": busy,
        "by_name": [{"name": n, "calls": c, "us": round(u, 2)} for n, c, u in rows],
    }


if __name__ == "__main__":
    sys.exit(main())
