"""How many streamed tokens a second the HTTP front end can deliver, and its CPU time per token, with an engine that
costs nothing: the real server (python -m fastqwen.serve, its engine-core clients, sockets and codec, detokenizer,
SSE encoding, uvicorn) in front of synthetic engine cores. Each synthetic core is a process that speaks the real core
protocol (engine/core_process.py) and, every --step-ms, emits one StepOutput with one token for each of its running
requests (up to --max-batch), finishing each at its max_tokens. So the engine side is free and what limits the
delivered rate is the front end (issue 45: one front end before two H200 replicas saturated near 19k tok/s).

A load client in a process of its own keeps --concurrency streams of /v1/completions in flight (text prompts of about
--input-len tokens, --output-len tokens with ignore_eos) over raw keep-alive HTTP/1.1 connections (httpx would cost
the shared cores more than the server's work), and reports over a --duration window after --warmup seconds:

- delivered tok/s against the offered rate (replicas x min(batch, concurrency / replicas) / step);
- the server's CPU seconds per 1,000 delivered tokens (utime + stime from /proc of the server process and, with
  --api-servers N, its N front-end processes; not the synthetic cores'): the primary figure, robust to the client
  sharing the cores;
- TTFT median and p99 of the requests that started in the window.

Every generated token is a 5-character word (" abcd": one token of Qwen3's vocabulary), so delivered tokens are the
streamed text's length / 5, however the server groups tokens into events.

    python bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
    python bench/frontend_rate.py --model /tmp/qwen3-8b-dummy --replicas 2 --concurrency 512 --duration 20 \
        [--profile /tmp/server.prof]

--ttft-lens N ... measures instead what the HTTP path adds to the time to first token by prompt length: one request
at a time (no --concurrency load), --ttft-repeats of each length, each a prompt of N random token ids with max_tokens
1, its body JSON encoded before the clock starts; the synthetic core answers at once (--step-ms 0 unless given), so
the median TTFT per length is the front end's and the sockets' work (issue 48: the 32k prompt's TTFT was 10 ms more
through HTTP than offline).

    python bench/frontend_rate.py --model /tmp/qwen3-8b-dummy --replicas 1 --ttft-lens 16 4096 32768

--profile writes a cProfile of the server process (event loop and core reader threads merged) for pstats (one front
end only). --api-servers N runs the server with --api-server-count N: N front-end processes, each a client of every
synthetic core; on a machine with fewer free cores than front ends plus the client, the delivered rate says little
and the CPU per token says what a front end costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

WORD = re.compile(r"^\u0120[a-z]{4}$")  # byte-level BPE's space marker, then four letters: " abcd"
CHARS_PER_TOKEN = 5


def word_tokens(folder: str) -> list[tuple[int, str]]:
    """(id, text) of the tokenizer's single-token 5-character words, in id order."""
    with open(os.path.join(folder, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    words = sorted((i, " " + w[1:]) for w, i in vocab.items() if WORD.match(w))
    if len(words) < 100:
        raise SystemExit(f"{folder}/tokenizer.json has only {len(words)} single-token words: use Qwen3's tokenizer")
    return words[:4096]


# ---- the synthetic engine core (runs in a process of its own, spawned by ProcessEngineClient) -------------------


def synthetic_core_main(config, folder: str, server_pid: int, log_level: int, replica: int | None = None) -> None:
    """core_process.core_main's protocol, with a free engine: see the module's docstring."""
    from collections import deque

    import zmq
    from fastqwen.config import GenerationDefaults
    from fastqwen.engine import core_process, lifeline
    from fastqwen.engine.messages import EngineInfo, EngineStats, RequestDelta, StepOutput

    lifeline.end_with_parent(server_pid, f"synthetic core {replica}")
    lifeline.remove_when_orphaned(folder)
    with open(os.path.join(os.environ["FRONTEND_RATE_CORES"], str(os.getpid())), "w"):
        pass  # (its CPU is not the front end's: the load client leaves it out)
    step_s = float(os.environ["FRONTEND_RATE_STEP_MS"]) / 1000
    max_batch = int(os.environ["FRONTEND_RATE_MAX_BATCH"])
    words = [i for i, _ in word_tokens(config.model)]
    links = core_process.FrontendLinks(zmq.Context(), folder, config.api_server_count)
    info = EngineInfo(
        config.model,
        151936,
        config.max_model_len or 4096,
        1 << 20,
        16,
        GenerationDefaults(),
        device=f"synthetic{replica}",
    )
    links.broadcast(b"info", info)
    waiting: deque = deque()
    running: dict[int, list[int]] = {}  # rid -> [tokens so far, max_tokens]

    def stats() -> EngineStats:
        return EngineStats(num_running=len(running), num_waiting=len(waiting))

    next_step = time.monotonic()
    while True:
        timeout_ms = max(0.0, (next_step - time.monotonic()) * 1000) if running or waiting else 50
        while (command := links.receive(timeout_ms)) is not None:
            timeout_ms = 0
            kind, value = command
            if kind == b"stop":
                return
            if kind == b"add":
                waiting.extend(value)
            elif kind == b"abort":
                for rid in value:
                    running.pop(rid, None)
                waiting = deque(r for r in waiting if r.rid not in value)
        now = time.monotonic()
        if not (running or waiting):
            links.send_stats(stats())
            next_step = now
            continue
        if now < next_step:
            continue
        first = set()  # admitted this step
        while waiting and len(running) < max_batch:
            request = waiting.popleft()
            running[request.rid] = [0, request.params.max_tokens]
            first.add(request.rid)
        deltas = []
        for rid, progress in list(running.items()):
            progress[0] += 1
            done = progress[0] >= progress[1]
            deltas.append(
                RequestDelta(
                    rid,
                    [words[(rid * 7 + progress[0]) % len(words)]],
                    None,
                    finish_reason="length" if done else None,
                    first_scheduled_time=now if rid in first else None,
                )
            )
            if done:
                del running[rid]
        links.send_step(StepOutput(deltas, time.monotonic(), len(deltas)), stats())
        next_step = max(next_step + step_s, now)  # a late step is not made up for with a burst


# ---- the server process ------------------------------------------------------------------------------------------


def serve(argv: list[str]) -> int:
    """fastqwen.serve with synthetic cores; with FRONTEND_RATE_PROFILE, profiled (event loop and reader threads)."""
    from fastqwen import serve as fastqwen_serve
    from fastqwen.engine import core_process

    core_process.core_main = synthetic_core_main  # ProcessEngineClient spawns whatever this names
    out = os.environ.get("FRONTEND_RATE_PROFILE")
    if not out:
        return fastqwen_serve.main(argv)
    import cProfile
    import pstats
    import threading

    profiles = []
    read = core_process.ProcessEngineClient._read

    def profiled_read(self, on_output, on_death):
        profile = cProfile.Profile(time.thread_time)  # CPU time: wall time would count waits for the GIL
        profiles.append(profile)
        profile.runcall(read, self, on_output, on_death)

    core_process.ProcessEngineClient._read = profiled_read
    main_profile = cProfile.Profile(time.thread_time)  # CPU time: wall time would count waits for the GIL
    try:
        return main_profile.runcall(fastqwen_serve.main, argv)
    finally:
        for thread in threading.enumerate():  # the readers end with the cores
            if thread.name == "fastqwen-core-reader":
                thread.join(5)
        stats = pstats.Stats(main_profile)
        for profile in profiles:
            stats.add(profile)
        stats.dump_stats(out)


# ---- the load client (a process of its own) ------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def server_processes(pid: int, cores: str) -> list[int]:
    """The server process and its descendants (front ends, with --api-servers), less the synthetic cores (each left
    its pid in the folder `cores`)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        found.append(parent)
        for task in os.listdir(f"/proc/{parent}/task"):
            with open(f"/proc/{parent}/task/{task}/children") as f:
                queue += [int(c) for c in f.read().split()]
    return [p for p in found if str(p) not in os.listdir(cores)]


async def load(args, words: list[str]) -> dict:
    rng = random.Random(0)
    delivered = 0  # tokens streamed so far, all requests
    ttfts: list[tuple[float, float]] = []  # (start, ttft)
    failures: list[str] = []
    stop_at = time.monotonic() + args.warmup + args.duration
    text_key = b'"text":"'

    async def worker() -> None:
        nonlocal delivered
        reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
        try:
            while time.monotonic() < stop_at:
                prompt = "".join(rng.choice(words) for _ in range(args.input_len))
                body = json.dumps(
                    {
                        "model": args.model,
                        "prompt": prompt,
                        "max_tokens": args.output_len,
                        "ignore_eos": True,
                        "stream": True,
                    }
                ).encode()
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                start = time.monotonic()
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    failures.append(head.split(b"\r\n", 1)[0].decode())
                    return
                first = None
                tokens = 0
                while True:  # chunked: each chunk is whole events (the server writes events whole)
                    size = int(await reader.readline(), 16)
                    if size == 0:
                        await reader.readline()
                        break
                    chunk = await reader.readexactly(size + 2)
                    at = chunk.find(text_key)
                    while at >= 0:
                        end = chunk.index(b'"', at + len(text_key))
                        n = (end - at - len(text_key)) // CHARS_PER_TOKEN
                        if n and first is None:
                            first = time.monotonic()
                        tokens += n
                        delivered += n
                        at = chunk.find(text_key, end)
                if tokens != args.output_len:
                    failures.append(f"{tokens} tokens streamed, {args.output_len} asked")
                ttfts.append((start, (first or start) - start))
        finally:
            writer.close()

    async def measure() -> dict:
        await asyncio.sleep(args.warmup)
        pids = server_processes(args.server_pid, args.cores)
        t0, n0, c0 = time.monotonic(), delivered, sum(map(cpu_seconds, pids))
        await asyncio.sleep(args.duration)
        t1, n1, c1 = time.monotonic(), delivered, sum(map(cpu_seconds, pids))
        return {"seconds": t1 - t0, "tokens": n1 - n0, "server_cpu_s": c1 - c0, "window": (t0, t1)}

    workers = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
    figures = await measure()
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    t0, t1 = figures.pop("window")
    window = sorted(ttft for start, ttft in ttfts if t0 <= start < t1)
    figures["ttft_s"] = (
        {"median": window[len(window) // 2], "p99": window[min(len(window) - 1, int(0.99 * len(window)))]}
        if window
        else None
    )
    figures["failures"] = failures[:5]
    figures["num_failures"] = len(failures)
    return figures


def client(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    for name in ("--port", "--server-pid", "--concurrency", "--input-len", "--output-len"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--warmup", type=float, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--cores", required=True)
    args = p.parse_args(argv)
    words = [w for _, w in word_tokens(args.folder)]
    print(json.dumps(asyncio.run(load(args, words))))
    return 0


def ttft_by_length(port: int, lens: list[int], repeats: int, vocab: int) -> dict:
    """Median (and every) TTFT in ms of one-token completions of each prompt length, one request at a time over one
    kept-alive connection (latency.py's HTTP client), after a warm-up request of each length; the prompt lengths as
    the server counted them (the stream's usage)."""
    from latency import http_latency

    rng = random.Random(0)
    url = f"http://127.0.0.1:{port}"
    rows = []
    for n in lens:
        http_latency(url, [rng.randrange(vocab) for _ in range(n)], 1)  # warm-up
        runs = [http_latency(url, [rng.randrange(vocab) for _ in range(n)], 1) for _ in range(repeats)]
        rows.append(
            {
                "prompt_tokens": n,
                "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
                "runs_ms": [round(r["ttft_ms"], 3) for r in runs],
                "prompt_tokens_seen": sorted({r["prompt_tokens"] for r in runs}),
            }
        )
    return {"ttft_by_length": rows}


# ---- the driver ----------------------------------------------------------------------------------------------------


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return serve(sys.argv[2:])
    if sys.argv[1:2] == ["--client"]:
        return client(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", required=True, help="a checkpoint folder with Qwen3's tokenizer (make_dummy_checkpoint.py)"
    )
    p.add_argument("--replicas", type=int, default=2, help="synthetic engine cores (--dp); 1: one core, no --dp")
    p.add_argument(
        "--api-servers", type=int, default=1, help="front-end processes (--api-server-count); the CPU is theirs all"
    )
    p.add_argument("--concurrency", type=int, default=512, help="streams in flight")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--step-ms", type=float, help="each core's step time (default 20; 0 with --ttft-lens)")
    p.add_argument("--max-batch", type=int, default=256, help="each core's running requests at most")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the window")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured")
    p.add_argument(
        "--ttft-lens", type=int, nargs="+", help="measure TTFT by prompt length instead (one request at a time)"
    )
    p.add_argument("--ttft-repeats", type=int, default=21, help="requests of each --ttft-lens length")
    p.add_argument("--profile", help="write the server's cProfile here (slows it: compare shares, not rates)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if args.step_ms is None:  # with --ttft-lens the synthetic core answers at once: the TTFT is the front end's
        args.step_ms = 0.0 if args.ttft_lens else 20.0

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import httpx
    from server_process import free_port

    port = free_port()
    cores = tempfile.mkdtemp(prefix="frontend-rate-cores-")
    env = dict(
        os.environ,
        FRONTEND_RATE_CORES=cores,
        FRONTEND_RATE_STEP_MS=str(args.step_ms),
        FRONTEND_RATE_MAX_BATCH=str(args.max_batch),
        FRONTEND_RATE_PROFILE=args.profile or "",
    )
    max_len = max(4096, max(args.ttft_lens or [0]) + 64, args.input_len + args.output_len + 64)  # (prompts: about)
    serve_args = ["--model", args.model, "--load-format", "dummy", "--port", str(port), "--max-model-len", str(max_len)]
    if args.replicas > 1:
        serve_args += ["--dp", str(args.replicas)]
    if args.api_servers > 1 and args.profile:
        raise SystemExit("--profile profiles one front end's process: use it without --api-servers")
    serve_args += ["--api-server-count", str(args.api_servers)]  # (always: its default follows --dp)
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *serve_args], env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        if args.ttft_lens:
            with open(os.path.join(args.model, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            figures = ttft_by_length(port, args.ttft_lens, args.ttft_repeats, vocab)
        else:
            result = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--client", "--port", str(port), "--server-pid",
                 str(server.pid), "--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--warmup", str(args.warmup), "--duration", str(args.duration),
                 "--model", args.model, "--folder", args.model, "--cores", cores],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            figures = json.loads(result.stdout)
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(cores, ignore_errors=True)
    if args.ttft_lens:
        figures["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "profile")}
        for row in figures["ttft_by_length"]:
            print(f"prompt {row['prompt_tokens']:>6} tokens: TTFT median {row['ttft_ms']:.2f} ms "
                  f"({len(row['runs_ms'])} requests, one at a time, synthetic core)")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
        return 0
    per_replica = min(args.max_batch, -(-args.concurrency // args.replicas))
    offered = args.replicas * per_replica / (args.step_ms / 1000)
    rate = figures["tokens"] / figures["seconds"]
    cpu_per_1k = 1000 * figures["server_cpu_s"] / max(1, figures["tokens"])
    figures.update(
        settings={k: v for k, v in vars(args).items() if k not in ("json", "profile")},
        delivered_tok_s=rate,
        offered_tok_s=offered,
        server_cpu_ms_per_1k_tokens=1000 * cpu_per_1k,
        server_cpu_cores=figures["server_cpu_s"] / figures["seconds"],
    )
    ttft = figures["ttft_s"] or {}
    print(
        f"delivered {rate:,.0f} tok/s of {offered:,.0f} offered ({args.replicas} synthetic cores, "
        f"{args.api_servers} front-end processes, "
        f"{args.concurrency} in flight, {args.input_len} in / {args.output_len} out)\n"
        f"server CPU: {1000 * cpu_per_1k:.1f} ms per 1k tokens ({figures['server_cpu_cores']:.2f} cores busy)\n"
        f"TTFT median {ttft.get('median', float('nan')):.3f} s, p99 {ttft.get('p99', float('nan')):.3f} s; "
        f"{figures['num_failures']} failed requests {figures['failures']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 1 if figures["num_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
