"""Every environment variable fastqwen reads, in one place: its name, its default and what it changes.

Read through these functions only, so that a grep for FASTQWEN_ here lists them all (tests/test_env.py checks that
nothing else in the package reads the environment). One rule for fastqwen's on/off switches (`_flag`): unset or
empty is the default; "0", "false", "False", "no", "off" are off; anything else is on. Variables of other tools' conventions
(OPENAI_API_KEY, NO_COLOR) keep their own meaning, written beside them. (One more is read in C++:
FASTQWEN_SAMPLER_ASYNC=0 makes the sampler's scan use plain register loads instead of cp.async, for comparison.)
"""

from __future__ import annotations

import os


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value not in ("0", "false", "False", "no", "off")


def disable_cuda_kernels() -> bool:
    """FASTQWEN_DISABLE_CUDA_KERNELS=1: every op runs its PyTorch reference, even where the CUDA kernel applies."""
    return _flag("FASTQWEN_DISABLE_CUDA_KERNELS", False)


def allow_reference_on_gpu() -> bool:
    """FASTQWEN_ALLOW_REFERENCE_ON_GPU=1: run on a GPU although fastqwen._C has no CUDA kernels, every op on its PyTorch
    reference (the same as EngineConfig.allow_reference_on_gpu)."""
    return _flag("FASTQWEN_ALLOW_REFERENCE_ON_GPU", False)


def check_invariants_every_step() -> bool:
    """FASTQWEN_CHECK_INVARIANTS=1: check the KV page ownership invariant after every engine step (slow; for debugging)."""
    return _flag("FASTQWEN_CHECK_INVARIANTS", False)


def gpu_sampler() -> bool:
    """FASTQWEN_GPU_SAMPLER=0: sample with the PyTorch reference ops instead of the CUDA sampler."""
    return _flag("FASTQWEN_GPU_SAMPLER", True)


def programmatic_launch() -> bool:
    """FASTQWEN_PDL=0: each kernel of a decode step waits for the kernel before it to end before it starts (no
    programmatic dependent launch; for comparison)."""
    return _flag("FASTQWEN_PDL", True)


def verify_gate() -> bool:
    """FASTQWEN_VERIFY_GATE=0: a verify step is launched once the host has its drafts, instead of being queued behind
    the host gate while the step before it runs (ops/host_gate.py); for comparison."""
    return _flag("FASTQWEN_VERIFY_GATE", True)


def verify_chain() -> bool:
    """FASTQWEN_VERIFY_CHAIN=0: prompt lookup's verify steps are not chained on the device (engine/verify_chain.py);
    the host gate, if on, queues them instead; for comparison."""
    return _flag("FASTQWEN_VERIFY_CHAIN", True)


def gemv_tensor_cores() -> bool:
    """FASTQWEN_GEMV_TENSOR_CORES=0: projections of 2 to 8 tokens skip the GEMV's tensor-core kernel: linear() then
    runs cuBLAS or the FP8 GEMM there, as before that kernel (gemv() itself its FMA kernel); for comparison."""
    return _flag("FASTQWEN_GEMV_TENSOR_CORES", True)


def gemv_five_rows() -> bool:
    """FASTQWEN_GEMV_FIVE_ROWS=0: the one-token GEMV's rule of rows a block chooses between 4 and 6 only, as before
    blocks of 5 (csrc/gemv.cu rows_per_block); for comparison."""
    return _flag("FASTQWEN_GEMV_FIVE_ROWS", True)


def gemv_tc_fp8_variant() -> int | None:
    """FASTQWEN_GEMV_TC_FP8_VARIANT=N: the pipeline of the tensor-core GEMV's FP8 kernel (csrc/gemv_tc.cu,
    set_gemv_tc_fp8_variant; 0 to the extension's GEMV_TC_FP8_PIPELINES - 1, which _native checks), for benchmarks
    that compare them in a whole engine; None when unset (the kernel's measured default stays). ValueError naming the
    variable for anything but a non-negative integer."""
    value = os.environ.get("FASTQWEN_GEMV_TC_FP8_VARIANT", "")
    if value == "":
        return None
    if not value.isdigit():
        raise ValueError(f"FASTQWEN_GEMV_TC_FP8_VARIANT={value!r}: expected a pipeline number (0, 1, ...)")
    return int(value)


def fused_all_reduce_norm(world: int) -> bool:
    """FASTQWEN_FUSED_ALLREDUCE_NORM: under tensor parallelism on GPUs, whether the custom all-reduce after o_proj and
    down also adds the residual and applies the RMSNorm that follows, in one kernel (ops/custom_all_reduce.py), for
    steps of up to FUSED_NORM_MAX_ROWS tokens (ops/collectives.py); otherwise the all-reduce and fused_add_rms_norm
    run one after the other (the same numbers). Unset: at two ranks only (world), where it is faster; at four the
    fused kernel's one block a row sends the row to three peers alone, and random Qwen3-32B at TP=4 ran 1.9% faster
    with the two kernels (bench/results/current/tensor-parallel.md). =1 or =0 sets it at any world size."""
    return _flag("FASTQWEN_FUSED_ALLREDUCE_NORM", world == 2)


def all_reduce_end_barrier() -> bool:
    """FASTQWEN_ALLREDUCE_END_BARRIER=1: the custom all-reduce waits at a second barrier at the end of each call, as
    before its buffers had two halves (csrc/custom_all_reduce.cu); for comparison. Every rank reads the same
    environment."""
    return _flag("FASTQWEN_ALLREDUCE_END_BARRIER", False)


def all_reduce_lamport() -> bool:
    """FASTQWEN_ALLREDUCE_LAMPORT (on by default): under tensor parallelism on GPUs, the custom all-reduce's messages
    of up to ops/custom_all_reduce.py's LAMPORT_MAX_BYTES wait at no barrier (each rank stores its input into the
    others' receive buffers, which start empty, and sums what arrives; csrc/custom_all_reduce.cu). =0 sends them
    through the one-barrier kernels too, for comparison. Every rank reads the same environment."""
    return _flag("FASTQWEN_ALLREDUCE_LAMPORT", True)


def gemv_sends() -> bool:
    """FASTQWEN_GEMV_SENDS=1: under tensor parallelism on GPUs, a one-token o_proj or down GEMV stores its output
    straight into the ranks' receive buffers of the barrier-free all-reduce (csrc/gemv.h kGemvSend), and the fused
    all-reduce + norm after it only waits for the rows and sums them (ParallelGroup.linear_to_all_reduce). Off by
    default: no faster on two H200s (bench/results/current/tensor-parallel.md). Every rank reads the same
    environment."""
    return _flag("FASTQWEN_GEMV_SENDS", False)


def fp8_fused_quant() -> bool:
    """FASTQWEN_FP8_FUSED_QUANT (on unless =0): with FP8 weights, at token counts that run the block-scaled FP8 GEMM,
    the GEMMs' inputs are quantized by the kernels that compute them, instead of written out and read back by the
    quantizer: the residual add + RMSNorm before qkv and gate_up (ops.fused_add_rms_norm_quantized) and the SiLU
    before down (ops.linear_silu_and_mul's quantize_for); the same GEMM inputs, bit for bit. =0 runs the norm and the
    SiLU into bf16 and the quantizer after them, for comparison (on an H200 the batch-512 step took 1.1% longer)."""
    return _flag("FASTQWEN_FP8_FUSED_QUANT", True)


def metrics_folder() -> str | None:
    """PROMETHEUS_MULTIPROC_DIR: prometheus_client's multiprocess mode, where each process writes its counters. Set
    by the parent of several front ends (api_servers.py, through share_metrics_through) before it starts them."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def share_metrics_through(folder: str) -> None:
    """Set PROMETHEUS_MULTIPROC_DIR for the processes started from now on (and any prometheus_client imported)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder


def api_key() -> str | None:
    """FASTQWEN_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("FASTQWEN_API_KEY") or None


def client_api_key() -> str | None:
    """The key `fastqwen chat --url` sends when --api-key is not given: FASTQWEN_API_KEY, else OPENAI_API_KEY (the
    OpenAI clients' variable, so that one exported key serves both)."""
    return os.environ.get("FASTQWEN_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


def no_color() -> bool:
    """NO_COLOR (no-color.org): set to any non-empty value, the terminal chat prints no styling. Its own rule, not
    `_flag`'s: by that convention NO_COLOR=0 also turns colour off."""
    return bool(os.environ.get("NO_COLOR"))
