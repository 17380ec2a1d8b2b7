"""bench/serving.py's per-request figures as the peers report them: TTFT to the chunk with the first token, TPOT =
(end-to-end - TTFT) / (tokens - 1), the chunk gap beside them; checked on timings worked out by hand, then with the
script against a tiny CPU server on both streaming APIs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from checkpoints import make_checkpoint
from server_process import ServerProcess

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
from serving import percentiles, request_metrics, summary, tokens_in  # noqa: E402


def test_one_requests_figures_by_hand():
    # Sent at 10.0; a chunk with no token at 10.5 (it must not count as the first token), tokens 1, 2+3, none, 4;
    # the stream ends at 11.4.
    chunks = [(10.5, 0), (10.7, 1), (10.9, 2), (11.0, 0), (11.3, 1)]
    m = request_metrics(10.0, chunks, 11.4)
    assert m["output_tokens"] == 4
    assert m["ttft"] == pytest.approx(0.7)
    assert m["e2e"] == pytest.approx(1.4)
    assert m["tpot"] == pytest.approx(0.7 / 3)  # (1.4 - 0.7) / (4 - 1)
    assert m["chunk_gap"] == pytest.approx(0.6 / 3)  # (11.3 - 10.7) / (4 - 1): the tail after 11.3 left out
    single = request_metrics(0.0, [(0.25, 1), (0.3, 0)], 0.4)
    assert (single["ttft"], single["tpot"], single["chunk_gap"]) == (0.25, None, None)


def test_summary_over_requests():
    requests = [
        {"ok": True, "ttft": t, "tpot": p, "chunk_gap": g, "e2e": e}
        for t, p, g, e in [
            (0.1, 0.01, 0.008, 1.0),
            (0.4, 0.03, 0.02, 2.0),
            (0.2, None, None, 0.2),
            (0.3, 0.02, 0.01, 3),
        ]
    ]
    requests.append({"ok": False})
    s = summary(requests)
    assert s["ttft_ms"]["mean"] == pytest.approx(250.0) and s["ttft_ms"]["median"] == pytest.approx(250.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(400.0) and s["ttft_ms"]["max"] == pytest.approx(400.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(20.0) and s["tpot_ms"]["median"] == pytest.approx(20.0)
    assert s["chunk_gap_ms"]["median"] == pytest.approx(10.0)
    assert s["e2e_s"]["median"] == pytest.approx(1.5)
    assert percentiles([]) == {}


def test_tokens_per_completions_event():
    assert tokens_in({"text": "", "logprobs": None, "finish_reason": None}) == 1  # a token whose text is held back
    assert tokens_in({"text": "", "logprobs": None, "finish_reason": "length"}) == 0
    assert tokens_in({"text": "ab", "logprobs": {"tokens": ["a", "b"]}, "finish_reason": None}) == 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("reporting"))
    make_checkpoint(folder, tied=True, seed=3)
    srv = ServerProcess(folder, "--dtype", "float32", "--device", "cpu", "--num-pages", "64", "--page-size", "4")
    yield srv
    srv.stop()


@pytest.mark.parametrize("api", ["completions", "generate"])
def test_serving_script_reports_per_request_figures(server, api, tmp_path):
    out = tmp_path / "out.json"
    args = ["--num-prompts", "4", "--concurrency", "2", "--input-len", "8", "--output-len", "6", "--vocab", "300"]
    run = subprocess.run(
        [sys.executable, os.path.join(BENCH, "serving.py"), "--url", server.url, "--api", api, *args, "--json", out],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["api"] == api and result["completed"] == 4 and result["total_output_tokens"] == 24
    for key in ("ttft_ms", "tpot_ms", "chunk_gap_ms"):
        assert set(result[key]) == {"mean", "median", "p90", "p99", "max"}
    assert len(result["requests"]) == 4
    for r in result["requests"]:
        assert r["output_tokens"] == 6
        assert 0 < r["ttft"] < r["e2e"]
        assert r["tpot"] * 5 + r["ttft"] == pytest.approx(r["e2e"], rel=1e-9)
        assert r["chunk_gap"] * 5 <= r["e2e"] - r["ttft"]
    middle = sorted(r["tpot"] * 1e3 for r in result["requests"])[1:3]  # the median of four: the middle two's mean
    assert result["tpot_ms"]["median"] == pytest.approx(sum(middle) / 2)


def test_latency_http_mode_reports_the_same_figures(server):
    from latency import http_latency

    r = http_latency(server.url, [5, 9, 14, 3], 5)
    assert r["output_tokens"] == 5
    assert 0 < r["ttft_ms"] < r["e2e_ms"]
    assert r["tpot_ms"] * 4 + r["ttft_ms"] == pytest.approx(r["e2e_ms"], rel=1e-9)
    assert r["chunk_gap_ms"] > 0 and r["chunk_gap_mean_ms"] * 4 <= r["e2e_ms"] - r["ttft_ms"]


def run_latency_main(tmp_path, monkeypatch, http_latency, args: str) -> dict:
    """bench/latency.py's main on the CPU with a tiny checkpoint and a stand-in for its HTTP measurement: its JSON."""
    import latency

    folder = str(tmp_path / "ckpt")
    make_checkpoint(folder, tied=True, seed=3)
    monkeypatch.setattr(latency, "http_latency", http_latency)
    out = tmp_path / "o.json"
    argv = f"--model {folder} --load-format auto --device cpu --dtype float32 --max-model-len 512 --new-tokens 3"
    argv += f" --url http://unused --json {out} {args}"
    monkeypatch.setattr(sys, "argv", ["latency.py", *argv.split()])
    assert latency.main() == 0
    return json.loads(out.read_text())


def test_latency_side_by_side_warms_the_server_before_the_first_row(tmp_path, monkeypatch):
    # On an H100 (2264acf) the first row through HTTP was the client's first stream: 66 ms TTFT against 31 ms warm,
    # and a TPOT under the weight-read limit. The HTTP warm-up must come before any measured row.
    sent = []

    def record(url, prompt, new_tokens):
        sent.append((list(prompt), new_tokens))
        return {"ttft_ms": 1.0, "tpot_ms": 1.0, "chunk_gap_ms": 1.0, "chunk_gap_mean_ms": 1.0, "e2e_ms": 2.0}

    result = run_latency_main(tmp_path, monkeypatch, record, "--prompt-lens 8 12")
    assert [r["prompt_tokens"] for r in result["rows"]] == [8, 12]
    lengths = [len(prompt) for prompt, _ in sent]
    assert len(lengths) == 4 and lengths[1:] == [8, 12, 256]  # a warm-up first, then the rows and the TTFT request


def test_latency_repeats_report_each_figures_median_over_fresh_prompts(tmp_path, monkeypatch):
    # One 128-token request with speculation moved by 0.2 ms a token between calls on an H100: --repeats N sends N
    # fresh prompts per length and reports each figure's median, with the runs beside it.
    sent, tpots = [], iter([9.0, 1.0, 8.0, 3.0, 7.0])  # (the first is the warm-up's)

    def record(url, prompt, new_tokens):
        sent.append(list(prompt))
        return {"ttft_ms": 1.0, "tpot_ms": next(tpots, 1.0), "e2e_ms": 2.0}

    (row,) = run_latency_main(tmp_path, monkeypatch, record, "--prompt-lens 8 --repeats 3")["rows"]
    assert [r["tpot_ms"] for r in row["http_runs"]] == [1.0, 8.0, 3.0]
    assert row["http"]["tpot_ms"] == 3.0  # the median, not the mean (4.0)
    assert (
        len(row["offline_runs"]) == 3
        and row["offline"]["tpot_ms"] == sorted(r["tpot_ms"] for r in row["offline_runs"])[1]
    )
    assert len({tuple(p) for p in sent[1:4]}) == 3  # a fresh prompt for each run


def test_profile_step_gate_path_by_hand():
    """bench/profile_step.py's gate_path: per gated step, the gaps between the stamps from the tokens' arrival to the
    gate's opening, medians over steps; stamps outside that path (a step that opened no gate) count nothing."""
    from profile_step import gate_path

    stamps = [
        ("tokens", 1.000),
        ("recorded", 1.010),
        ("drafted", 1.030),
        ("opened", 1.060),  # 10, 20, 30 ms
        ("recorded", 1.500),
        ("drafted", 1.600),  # no tokens stamp before them: not a gated step's path
        ("tokens", 2.000),
        ("recorded", 2.030),
        ("drafted", 2.040),
        ("opened", 2.050),  # 30, 10, 10 ms
        ("tokens", 3.000),
        ("recorded", 3.020),
        ("drafted", 3.050),
        ("opened", 3.060),  # 20, 30, 10 ms
    ]
    path = gate_path(stamps, [40_000_000, 70_000_000, 50_000_000])
    assert path["recorded"] == pytest.approx(20.0)
    assert path["drafted"] == pytest.approx(20.0)
    assert path["opened"] == pytest.approx(10.0)
    assert path["tokens_to_open"] == pytest.approx(60.0)  # 60, 50, 60
    assert path["gpu_wait"] == pytest.approx(50.0) and path["gates"] == 3


def test_profile_step_times_steps_that_decode_the_whole_batch(tmp_path):
    """bench/profile_step.py on a tiny checkpoint on the CPU, 8 prompts of 64 tokens prefilled in chunks of 128 (4
    prefill steps, during which the sequences prefilled first decode, since decodes go first in a step): it ends, and
    each of its 2 timed steps decoded all 8 sequences (with room for only the timed steps' tokens, the first
    sequences finished before the last began to decode, and the run never ended)."""
    model = str(tmp_path / "model")
    make_checkpoint(model, tied=False)
    out = tmp_path / "step.json"
    args = ["--model", model, "--device", "cpu", "--max-model-len", "512", "--batch", "8", "--prompt-len", "64"]
    args += ["--steps", "2", "--max-num-batched-tokens", "128", "--json", str(out)]
    subprocess.run([sys.executable, "profile_step.py", *args], cwd=BENCH, check=True, timeout=240, capture_output=True)
    result = json.loads(out.read_text())
    assert result["decode_steps"] == 2 and result["decode_batch_min"] == 8


def test_ab_summary_pairs_the_builds_decode_steps(tmp_path):
    """bench/ab_summary.py on bench/profile_step.py's files: the engine step and the graph replay, medians over each
    build's runs in us, and their ratio (figures by hand)."""
    from ab_summary import summarize

    for name, step, gpu in [
        ("new_1", 14.0, 15.0),
        ("new_2", 14.2, 14.8),
        ("base_1", 15.0, 15.5),
        ("base_2", 14.8, 15.3),
    ]:
        data = {"batch": 256, "prompt_tokens": 640, "step_ms": step, "gpu_ms": gpu, "host_ms_excluding_wait": 5.0}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    table = {r["op"]: r for r in summarize(tmp_path)}
    assert set(table) == {"decode step (engine)", "decode step (graph replay)"}
    engine, replay = table["decode step (engine)"], table["decode step (graph replay)"]
    assert engine["case"] == "256x640"
    assert engine["new_us"] == pytest.approx(14100.0) and engine["base_us"] == pytest.approx(14900.0)
    assert replay["new_over_base"] == pytest.approx(14900.0 / 15400.0)


def test_ab_summary_pairs_the_builds_rows(tmp_path):
    """bench/ab_summary.py: per decode case and prefill shape found in every run, the medians of our kernel's time
    over each build's runs and their ratio (figures by hand); a case missing from a run is left out."""
    from ab_summary import summarize

    def kernels_json(name, decode_us, prefill_us, extra_case=False):
        decode = [{"op": "paged_attention_decode", "kv_dtype": "fp8", "case": "512:640", "ours_us": decode_us}]
        if extra_case:
            decode.append({"op": "paged_attention_decode", "kv_dtype": "fp8", "case": "1:128", "ours_us": 5.0})
        prefill = [
            {
                "op": "paged_attention_prefill",
                "kv_dtype": "bf16",
                "batch": 1,
                "new_tokens": 2048,
                "prefix": 30720,
                "ours_us": prefill_us,
            }
        ]
        (tmp_path / f"{name}.json").write_text(json.dumps({"decode": decode, "prefill": prefill}))

    kernels_json("new_1", 200.0, 900.0, extra_case=True)
    kernels_json("new_2", 230.0, 1000.0)
    kernels_json("new_3", 190.0, 980.0)
    kernels_json("base_1", 240.0, 1000.0)
    kernels_json("base_2", 250.0, 1010.0)
    kernels_json("base_3", 300.0, 1200.0)
    table = summarize(tmp_path)
    assert [(r["case"], r["kv_dtype"]) for r in table] == [("512:640", "fp8"), ("1x2048+30720", "bf16")]
    decode, prefill = table
    assert decode["new_us"] == 200.0 and decode["base_us"] == 250.0  # (medians: the means are 206.7 and 263.3)
    assert decode["new_over_base"] == pytest.approx(0.8)
    assert prefill["new_us"] == 980.0 and prefill["base_us"] == 1010.0


def test_kernel_families_of_profiler_names():
    """bench/common.py's kernel_family sorts the names the profiler gives a prefill's kernels (written out here from an
    H100 trace's kinds) into the families latency.py --ttft-profile reports, and family_times sums them."""
    from types import SimpleNamespace

    from common import family_times, kernel_family

    names = {
        "void fastqwen::(anonymous namespace)::prefill_hopper_kernel<(int)10, __nv_bfloat16>(Params)": "attention",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT": "projections",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off": (
            "projections"
        ),
        "void fastqwen::(anonymous namespace)::rms_norm_kernel<__nv_bfloat16, 8>(...)": "norms + rope/kv",
        "void fastqwen::(anonymous namespace)::qk_norm_rope_kernel<__nv_bfloat16>(...)": "norms + rope/kv",
        "void fastqwen::(anonymous namespace)::silu_and_mul_kernel<__nv_bfloat16>(...)": "activation",
        "void fastqwen::(anonymous namespace)::one_shot_add_rms_norm_kernel<__nv_bfloat16, 2, 1, true>(...)": (
            "all-reduce"  # (the all-reduce fused with the norm is the all-reduce's)
        ),
        "void fastqwen::(anonymous namespace)::lamport_kernel<__nv_bfloat16, 2>(...)": "all-reduce",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all-reduce",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(...)": "other",
        "Memcpy DtoD (Device -> Device)": "other",
    }
    for name, family in names.items():
        assert kernel_family(name) == family, name
    events = [SimpleNamespace(name=n, device_time=t) for n, t in [(list(names)[0], 1500.0), (list(names)[1], 250.0),
              (list(names)[2], 750.0), (list(names)[-2], 10.0)]]  # fmt: skip
    times = family_times(events)
    assert list(times) == ["attention", "projections", "other"]  # (largest first)
    assert times["attention"] == {"ms": 1.5, "kernels": 1} and times["projections"] == {"ms": 1.0, "kernels": 2}
    assert times["other"] == {"ms": 0.01, "kernels": 1}


def test_per_decode_step_subtracts_the_prefill_and_divides_by_the_steps():
    """bench/common.py per_decode_step: a request that decoded 4 tokens after its first, less one that stopped at its
    first (families only the first has, one only the second has), per step; figures worked out by hand."""
    from common import per_decode_step

    whole = {
        "projections": {"ms": 10.0, "kernels": 21},
        "attention": {"ms": 1.2, "kernels": 9},
        "all-reduce": {"ms": 0.8, "kernels": 8},
    }
    prefill_only = {
        "projections": {"ms": 2.0, "kernels": 5},
        "attention": {"ms": 0.4, "kernels": 1},
        "other": {"ms": 0.1, "kernels": 2},
    }
    rows = per_decode_step(whole, prefill_only, 4)
    assert rows == {
        "projections": {"us": 2000.0, "kernels": 4.0},  # (10 - 2) ms / 4
        "attention": {"us": 200.0, "kernels": 2.0},  # (1.2 - 0.4) ms / 4
        "all-reduce": {"us": 200.0, "kernels": 2.0},  # (nothing before the first token)
    }
    assert list(rows)[0] == "projections"  # (largest first)


def test_decode_profile_runs_on_a_cpu_engine(tmp_path):
    """latency.py's decode_profile end to end on a tiny CPU engine (no CUDA kernels, so no families): its row names
    the prompt, the decode steps and a TPOT."""
    import random

    from fastqwen import LLM
    from latency import decode_profile

    make_checkpoint(str(tmp_path), tied=True)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    row = decode_profile(llm, 20, 5, random.Random(0))
    assert row["prompt_tokens"] == 20 and row["decode_steps"] == 4 and row["tpot_mean_ms"] > 0
    assert row["families"] == {} and row["kernels_us_per_step"] == 0 and row["per_layer_us"] == {}


def test_ttft_profile_runs_on_a_cpu_engine(tmp_path):
    """latency.py's ttft_profile end to end on a tiny CPU engine (no CUDA kernels, so no families): its row names the
    prompt, the chunk size the engine prefilled it in, and a TTFT."""
    import random

    from fastqwen import LLM
    from latency import ttft_profile

    make_checkpoint(str(tmp_path), tied=True)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=32)
    row = ttft_profile(llm, 100, random.Random(0))
    assert row["prompt_tokens"] == 100 and row["chunk_tokens"] == 32 and row["ttft_ms"] > 0
    assert row["families"] == {} and row["kernels_ms"] == 0


class _FakeGraph:
    """A stand-in for a CUDA graph in interleaved_medians' tests: time_fn gets its replay, named."""

    def __init__(self, name):
        self.name = name

    def replay(self):
        pass


def _fake_graphs(*names) -> dict:
    return {name: _FakeGraph(name) for name in names}


def _fake_timing(monkeypatch, common, ms_of) -> list:
    """common.time_fn replaced: each call recorded as (graph name, iters, warmup), its time ms_of(name)."""
    calls = []

    def fake_time_fn(fn, iters, warmup=5, queue_ahead=False):
        name = fn.__self__.name
        calls.append((name, iters, warmup))
        return ms_of(name)

    monkeypatch.setattr(common, "time_fn", fake_time_fn)
    return calls


def test_interleaved_medians_take_turns_and_report_each_median(monkeypatch):
    """bench/common.py interleaved_medians: the graphs alternate within each round (a clock drift over the run then
    reaches a kernel and its reference alike), and each figure is the median of its own rounds."""
    import common

    times = {"ours": iter([5.0, 1.0, 3.0]), "cudnn": iter([2.0, 9.0, 4.0])}
    calls = _fake_timing(monkeypatch, common, lambda name: next(times[name]))
    medians = common.interleaved_medians(_fake_graphs("ours", "cudnn"), iters=10, rounds=3)
    assert [name for name, _, _ in calls] == ["ours", "cudnn"] * 3
    assert medians == {"ours": 3.0, "cudnn": 4.0}


def test_interleaved_medians_settle_each_graph_before_its_samples(monkeypatch):
    """With settle_ms, each graph's samples follow about that long of its own untimed replays: the warm-up count is
    settle_ms over a first replay's time (0.5 ms: 200 for 100 ms; 40 ms: 5, the least)."""
    import common

    once = {"ours": 0.5, "cudnn": 40.0}
    calls = _fake_timing(monkeypatch, common, once.__getitem__)
    common.interleaved_medians(_fake_graphs("ours", "cudnn"), iters=10, rounds=2, settle_ms=100)
    assert calls == [("ours", 1, 1), ("cudnn", 1, 1)] + [("ours", 10, 200), ("cudnn", 10, 5)] * 2


def test_attention_by_chunk_splits_the_calls_in_launch_order():
    """bench/common.py attention_by_chunk: a 10-token prompt in chunks of 4 (4 on 0, 4 on 4, 2 on 8 cached) over two
    layers; the events come out of launch order and with a projection among them. FLOPs written out by hand."""
    from types import SimpleNamespace

    from common import attention_by_chunk

    def event(name, start, us):
        return SimpleNamespace(name=name, device_time=us, time_range=SimpleNamespace(start=start))

    attn = "prefill_hopper_kernel<...>"
    events = [event(attn, 5, 30.0), event(attn, 0, 10.0), event("nvjet_gemm", 1, 99.0), event(attn, 2, 10.0),
              event(attn, 3, 20.0), event(attn, 4, 20.0), event(attn, 6, 30.0)]  # fmt: skip
    rows = attention_by_chunk(events, 10, 4, heads=2, head_dim=8)
    # a layer: 4 * 2 * 8 = 64 FLOPs per (query, key) pair; pairs 4*5/2 = 10, 4*4 + 10 = 26, 2*8 + 3 = 19
    assert [(r["prefix"], r["new"], r["ms"]) for r in rows] == [(0, 4, 0.02), (4, 4, 0.04), (8, 2, 0.06)]
    assert [r["tflops"] for r in rows] == [round(2 * 64 * p / (ms * 1e9), 1) for p, ms in [(10, 0.02), (26, 0.04),
                                                                                          (19, 0.06)]]  # fmt: skip
    assert attention_by_chunk(events[:3], 10, 4, heads=2, head_dim=8) == []  # (calls not a whole number of chunks)
    # the last layer's decode kernel (its sampling row alone) is not a chunk's prefill
    assert attention_by_chunk(events + [event("decode_kernel<...>", 7, 5.0)], 10, 4, heads=2, head_dim=8) == rows


def test_idle_gaps_merge_overlapping_kernels():
    """bench/common.py idle_gaps: kernels at [0, 10], [5, 20] (overlapping), [50, 60], [52, 55] (inside the one
    before: it ends nothing), [61, 100] us: idle 30 + 1 us, one gap of 20 us or more, 30 us long, starting 20 us
    into the span."""
    from types import SimpleNamespace

    from common import idle_gaps

    spans = [(50, 60), (0, 10), (61, 100), (52, 55), (5, 20)]
    events = [SimpleNamespace(time_range=SimpleNamespace(start=a, end=b)) for a, b in spans]
    gaps = idle_gaps(events)
    assert gaps == {
        "span_ms": 0.1,
        "idle_ms": 0.031,
        "gaps": 1,
        "gaps_ms": 0.03,
        "longest": [{"us": 30, "at_ms": 0.02}],
    }
