"""LLMEngine: loads a checkpoint (or dummy weights), sizes the KV pool, and runs scheduler steps.

It sees token ids only: EngineRequests come in, one StepOutput per step goes out (engine/messages.py). Text,
stop strings and request validation against the tokenizer belong to the frontend (frontend.py)."""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from .. import env, model_source, ops
from ..config import (
    ConfigError,
    EngineConfig,
    context_length,
    load_model_config,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_quantization,
)
from ..errors import InvalidRequestError
from ..grammar import GrammarCompiler
from ..kvcache import KVPool, RadixCache, check_kv_invariants
from ..kvcache.invariants import InvariantError
from ..limits import check_token_ids
from ..model import Qwen3Model, Qwen3WithBatch1Decode
from ..ops import _native
from ..ops.collectives import SINGLE, ParallelGroup
from ..pooling import architectures_of, detect_task
from ..scheduler import FinishReason, Request, RequestState, ScheduledBatch, ScheduledChunk, Scheduler
from ..sharding import Shard
from ..speculative import SpeculativeConfig, SpeculativeConfigError, Speculator
from ..speculative.config import MAX_SPECULATIVE_TOKENS
from ..weights import dummy_weights, fold_norms, load_kv_scales, load_weights
from .batch_limit import (
    TYPICAL_SEQUENCE_TOKENS,
    default_max_num_seqs,
    estimated_pool_pages,
    step_activation_bytes,
)
from .cuda_graph import DecodeGraphs, unsupported_reason
from .messages import EngineInfo, EngineRequest, EngineStats, RequestDelta, StepOutput
from .model_runner import ModelRunner
from .sampler import make_sampler
from .staging import staging_for
from .verify import emitted_tokens, sampling_rows

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive failed steps after which the engine gives up (EngineFault)
# Grammar masks are computed off the step, on the grammars' threads (grammar.GrammarMatcher), while the next step's
# forward runs: a row whose mask is not ready once the forward is done is dropped from its step (rows_without_masks),
# and its request sits steps out until the mask is (Scheduler) instead of holding the batch. The engine waits for a
# mask only when it has nothing else to run (IDLE_WAIT_S, at most, for the first compile or mask to finish). Under
# tensor parallelism every rank must make the same choices, and mask times differ between processes: there each step
# waits for every mask it needs (the synchronous behaviour).
IDLE_WAIT_S = 0.05
MASK_POLL_S = 0.0005  # how often a step checks whether its forward is done while it waits for masks


class EngineFault(RuntimeError):
    """A failure the engine cannot recover from: the process should exit non-zero, for a supervisor to restart it."""


def mask_computations(requests) -> list:
    """The mask computations still running for these requests' grammars."""
    return [p for r in requests if r.grammar is not None and (p := r.grammar.pending) is not None]


def rows_without_masks(requests: list[Request], busy, wait_for_all: bool) -> frozenset[int]:
    """The model runner's mask gate (ModelRunner.mask_gate): the sampling rows whose grammar mask is not ready, once
    `busy()` (the device still runs the step's forward) turns false; they are skipped and sit out until their mask is
    (Request.mask_missed). `wait_for_all` (tensor parallelism): every mask is waited for, and no row is skipped.

    A function of its arguments only: the runner holds it, and a bound method of the engine there would make a
    reference cycle (engine -> runner -> engine) that keeps a dropped engine, its CUDA graphs and events, alive until
    the garbage collector runs, which may be in the middle of another engine's graph capture (freeing a graph
    there invalidates the capture)."""
    waits = mask_computations(r for r in requests if not r.finished)
    if not waits:
        return frozenset()
    if wait_for_all:
        wait(waits)
        return frozenset()
    while waits and busy():
        wait(waits, timeout=MASK_POLL_S, return_when=FIRST_COMPLETED)
        waits = [f for f in waits if not f.done()]
    skipped = frozenset(i for i, r in enumerate(requests) if not r.finished and not r.mask_ready)
    for i in skipped:
        requests[i].mask_missed = True
    return skipped


def _unrecoverable(error: BaseException) -> bool:
    """Errors after which the device or the engine's bookkeeping cannot be trusted: a CUDA error (sticky: every
    later launch fails too), host memory exhaustion, a broken KV page invariant."""
    if isinstance(error, (MemoryError, InvariantError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text


# KV pool size on the CPU reference path when num_pages is not given.
_CPU_KV_BYTES = 1 << 30


def _cpu_default_pages(page_bytes: int) -> int:
    return max(1, _CPU_KV_BYTES // page_bytes)


def check_kernels_for(device: torch.device, allow_reference: bool) -> None:
    """Refuse to run on a CUDA device with a native module built without the CUDA kernels (pip found no nvcc):
    every op would silently take its PyTorch reference, many times slower and without CUDA graphs. Allowed when the
    caller asks for the reference path: allow_reference, FASTQWEN_ALLOW_REFERENCE_ON_GPU=1, or
    FASTQWEN_DISABLE_CUDA_KERNELS=1 (which turns the kernels off on purpose)."""
    if device.type != "cuda" or _native.has_cuda_kernels():
        return
    if allow_reference or env.allow_reference_on_gpu() or env.disable_cuda_kernels():
        log.warning("running the PyTorch reference ops on %s, as asked: slow, and no CUDA graphs", device)
        return
    if _native.native() is None:
        why = f"the native module fastqwen._C does not import ({_native.import_error()})"
    else:
        why = "the native module fastqwen._C was built without the CUDA kernels (no nvcc was found at build time)"
    raise RuntimeError(
        f"{why}, so on {device} every op would run its slow PyTorch reference. Build the kernels: put the CUDA "
        "toolkit's nvcc on PATH (or set CUDACXX) and reinstall with `pip install --no-build-isolation --no-deps .` "
        '(other GPUs than Hopper: add -Ccmake.define.FASTQWEN_CUDA_ARCHS=80); `python -c "import fastqwen._C as c; '
        'print(c.built_with_cuda)"` must print True. To run the reference path on the GPU anyway, pass '
        "allow_reference_on_gpu=True (--allow-reference-on-gpu) or set FASTQWEN_ALLOW_REFERENCE_ON_GPU=1."
    )


def _with_first_rows(scheduled: ScheduledBatch):
    """(chunk, index of its first sampling row) for every chunk; a chunk that does not sample gets -1."""
    row = 0
    for chunk in scheduled.chunks:
        yield chunk, (row if chunk.samples else -1)
        row += chunk.num_rows


def _with_first_token_rows(scheduled: ScheduledBatch):
    """(chunk, index of its first token row in the step's forward) for every chunk."""
    row = 0
    for chunk in scheduled.chunks:
        yield chunk, row
        row += chunk.num_tokens


class GateCredit:
    """Whether arming the host gate has paid lately. An opened gate saves the launch calls between two verify steps
    (0.1-0.4 ms on H100 hosts); a cancelled or timed-out one costs a whole verify step run on padding (4-6 ms): about
    COST opens' worth. Each open earns 1 (up to CAP), each waste costs COST, and the engine arms only at a credit of 0
    or more; below it, each verify step it would otherwise have armed for earns RECOVERY, so that after a burst of
    waste (EOS ends at a batch of 16, aborts) it tries again later instead of never. The loss is bounded: a workload
    that wastes a gate every few steps is gated for a few steps in every COST / RECOVERY (80)."""

    COST = 20
    CAP = 64
    RECOVERY = 0.25

    def __init__(self):
        self.credit = 0.0
        self._seen = (0, 0, 0)  # the runner's (opens, cancels, timeouts) when last counted

    def allows(self, runner) -> bool:
        """Count what the runner's gates did since the last call, then whether to arm the next one."""
        now = (runner.num_gate_opens, runner.num_gate_cancels, runner.num_gate_timeouts)
        opens, cancels, timeouts = (a - b for a, b in zip(now, self._seen))
        self._seen = now
        self.credit = min(self.credit + opens - self.COST * (cancels + timeouts), self.CAP)
        if self.credit >= 0:
            return True
        self.credit += self.RECOVERY
        return False


class LLMEngine:
    def __init__(self, config: EngineConfig | str, parallel: ParallelGroup = SINGLE, **knobs):
        """config: an EngineConfig, or a model path/preset plus EngineConfig's knobs as keywords.

        parallel: this rank's tensor-parallel group when the engine is one rank of several (engine/tensor_parallel.py
        starts them): the engine then loads its shard of the weights and sizes its KV pool like every other rank.
        """
        # A hub id becomes its local snapshot, the chat template its text; a missing file fails here, before loading.
        self.engine_config = config = model_source.resolve(EngineConfig.build(config, **knobs))
        self.parallel = parallel
        device = config.device
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        # KV-cache events (engine/kv_events.py): the cache records, the publisher's thread sends. Rank 0 alone
        # publishes (the other tensor-parallel ranks' caches are the same). Started first: a port in use fails now,
        # not after the model has loaded.
        self.kv_events = None
        events = config.kv_events_config
        if events is not None and events.publishes and config.enable_prefix_caching and parallel.rank == 0:
            from .kv_events import KVEventPublisher  # (the schema and its thread only when asked for)

            medium = "GPU" if self.device.type == "cuda" else "CPU"
            self.kv_events = KVEventPublisher(events, config.page_size, medium)
        try:
            self._build(config, parallel)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, parallel: ParallelGroup) -> None:
        """The rest of __init__: the weights, the KV pool, the cache, the scheduler, the runner."""
        model, page_size = config.model, config.page_size
        max_num_batched_tokens, seed = config.max_num_batched_tokens, config.seed
        check_kernels_for(self.device, config.allow_reference_on_gpu)
        self.config, self.generation_defaults = load_model_config(model, config.rope_scaling)
        self.dtype = resolve_dtype(config.dtype, self.config, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = context_length(self.config, config.max_model_len)

        folder = model if os.path.isdir(model) else os.path.dirname(model)
        shard = Shard(parallel.rank, parallel.size)
        # The model as this rank sees it: its heads and KV heads (the whole model on one rank).
        self.rank_config = shard.rank_config(self.config)
        self.fp8 = resolve_quantization(config.quantization, self.config)
        if config.load_format == "dummy":
            weights = dummy_weights(self.config, self.dtype, self.device, seed, fp8=self.fp8, shard=shard)
        else:
            weights = load_weights(folder, self.config, self.dtype, self.device, fp8=self.fp8, shard=shard)
        self.task = self._resolve_task(config, weights.lm_head is not None)
        # Where it runs, a one-sequence decode step carries its RMSNorms in the GEMVs (model/qwen3_batch1.py), the
        # norm weights folded into the dense projections after them at load (not for a model that pools: its final
        # norm must stay the norm it is, and it rarely decodes).
        # Speculative decoding (speculative/): parsed here, since an EAGLE-3 head changes how the target runs.
        spec_config = SpeculativeConfig.parse(config.speculative_config)
        eagle3 = spec_config is not None and spec_config.method == "eagle3"
        model_class = Qwen3Model
        pools = self.task != "generate"
        if config.norms_in_gemv and not pools and not eagle3 and Qwen3WithBatch1Decode.applies(weights, parallel):
            fold_norms(weights)
            model_class = Qwen3WithBatch1Decode
        cfg = self.rank_config
        page_bytes = KVPool.bytes_per_page(cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
        # The batch limit sizes the model's decode scratch, the staging buffer, the sampler's rows and the graphs: it
        # is chosen now, before any of them (engine/batch_limit.py).
        self.max_num_seqs = max_num_seqs = self._batch_limit(config, page_bytes, parallel)
        self.model = model_class(
            self.rank_config, weights, self.max_model_len, max_batch=max_num_seqs, parallel=parallel
        )

        head = self._eagle3_head(spec_config, weights, max_num_seqs) if eagle3 else None
        if head is not None:  # its KV pool gets as many pages as the target's (its own page bytes budgeted with them)
            c = head.config
            page_bytes += KVPool.bytes_per_page(1, page_size, c.num_kv_heads, c.head_dim, head.dtype)
        self.staging = staging_for(max_num_batched_tokens, max_num_seqs, self.max_model_len, page_size, self.device)
        # An embedding model never decodes (and may have no LM head to capture): no decode graphs. (With an EAGLE-3
        # head every graph also writes the target's hidden states at the head's layers: ModelRunner's capture_aux.)
        no_graphs = config.disable_cuda_graph or self.task == "embed"
        graph_bs = self._graph_max_bs(no_graphs, config.cuda_graph_max_bs, max_num_seqs)
        k_scales = v_scales = None
        if self.kv_dtype != self.dtype and config.load_format != "dummy":
            k_scales, v_scales = load_kv_scales(folder, cfg.num_layers)
            log.info(
                "FP8 KV cache: K scales %s, V scales %s",
                "from the checkpoint" if k_scales else "1.0",
                "from the checkpoint" if v_scales else "1.0",
            )
        # A verify step samples 1 + k rows per sequence, for batches up to the speculator's max_batch_size.
        verify_graph = None
        sampler_rows = self.staging.max_seqs
        if spec_config is not None:
            spec_bs = min(spec_config.max_batch_size, max_num_seqs)
            query_len = spec_config.num_speculative_tokens + 1
            sampler_rows = max(sampler_rows, spec_bs * query_len)
            if graph_bs and spec_bs:
                verify_graph = (spec_bs, query_len)
        # The sampler's buffers (and its penalty-count table, when graphs capture it) are allocated before the KV pool
        # is sized, so the pool gets what they leave.
        self.sampler = make_sampler(
            cfg.vocab_size, sampler_rows, self.device, self.generation_defaults.eos_token_ids, seed
        )
        if graph_bs:
            self.sampler.freeze()
        num_pages = config.num_pages
        if num_pages is None:
            graph_bytes = self._measure_graph_memory(graph_bs, page_size) if graph_bs else 0
            num_pages = self._default_num_pages(
                page_bytes, max_num_batched_tokens, max_num_seqs, config.gpu_memory_utilization, graph_bytes
            )
            # Every rank schedules the same pages: the rank with the least memory left sets the pool's size.
            num_pages = parallel.min_int(num_pages)
        self.kv = KVPool(
            cfg.num_layers,
            num_pages,
            page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
            k_scales,
            v_scales,
        )
        drafter = None
        if head is not None:
            from .eagle3_drafter import Eagle3Drafter

            # The head keeps K and V of the positions each running request computed itself (a prefix-cache hit is not
            # recomputed), packed into its own pages: no more pages than the target's, plus room for the drafts of
            # every request that drafts at once. So no request ever finds the head's pool full.
            c, k = head.config, spec_config.num_speculative_tokens
            head_pages = num_pages + head.max_batch * -(-(k - 1) // page_size)
            head_pool = KVPool(1, head_pages, page_size, c.num_kv_heads, c.head_dim, head.dtype, self.device)
            # Its draft steps replay CUDA graphs where the target's do (and the head runs kernels: the drafter checks).
            draft_graphs = graph_bs > 0 and self.device.type == "cuda"
            drafter = Eagle3Drafter(head, spec_config.num_speculative_tokens, head_pool, graphs=draft_graphs)
        self.speculator = Speculator(spec_config, drafter) if spec_config is not None else None
        recording = self.kv_events is not None
        self.cache = RadixCache(self.kv.allocator, page_size, recording) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.kv.allocator,
            page_size,
            max_num_seqs,
            max_num_batched_tokens,
            self.max_model_len,
            self.generation_defaults.eos_token_ids,
            self.cache,
            self.speculator,
        )
        # Structured output: grammars compile on the compiler's threads; a request waits here (not in the scheduler)
        # until its grammar is compiled and its first mask computed, so no step ever waits on either while other
        # requests could run.
        tokenizer_folder = config.tokenizer or folder  # --tokenizer (model_source resolved it to a folder)
        self.grammars = GrammarCompiler(
            os.path.join(tokenizer_folder, "tokenizer.json") if tokenizer_folder else None,
            cfg.vocab_size,
            self.generation_defaults.eos_token_ids,
            cache_bytes=config.grammar_cache_mib << 20,
        )
        self._compiling: list[tuple[Request, object]] = []  # (request, future of its compiled grammar)
        self._compile_failures: list[RequestDelta] = []  # reported with the next step
        self.check_every_step = env.check_invariants_every_step()
        self.runner = ModelRunner(
            self.model,
            self.kv,
            self.generation_defaults.eos_token_ids,
            seed,
            self.staging,
            cuda_graph_max_bs=graph_bs,
            sampler=self.sampler,
            verify_graph=verify_graph,
            capture_aux=eagle3,
        )
        if self.speculator is not None:
            # Verify graphs take drafts of one length: a short draft is filled up (any token is a valid guess).
            self.speculator.pad_drafts = self.runner.verify_graphs is not None
            if spec_config.method == "ngram" and parallel.single:  # prompt lookup has a kernel: it may chain
                self.runner.enable_chain(
                    self.scheduler.max_model_len,
                    spec_config.prompt_lookup_min,
                    spec_config.prompt_lookup_max,
                    spec_config.synthetic_acceptance_length,
                )
        self.runner.mask_gate = functools.partial(rows_without_masks, wait_for_all=not parallel.single)
        self._arrivals = itertools.count()  # admission order (preemption takes the newest first)
        # Overlap: a decode step whose batch is known before the previous step's tokens are (Scheduler.schedule_ahead)
        # is launched first, and the host records the previous step while the GPU runs it.
        self.overlap = not config.disable_overlap_schedule
        # (ScheduledBatch, PendingStep) launched and not recorded yet; (ScheduledBatch, None): chosen by the last
        # call, to be launched by the next (_launch_next).
        self._ahead = None
        self.num_ahead_steps = 0
        self.num_early_launches = 0  # steps launched before step() returned the one before them (_launch_next)
        self.num_chained_steps = 0  # verify steps made on the device from the one before (_chain_next)
        self._gate_credit = GateCredit()
        self._step_requests: list[Request] = []  # the requests of the step in progress: those a failure fails
        self._failed_steps = 0  # in a row
        self._log_summary()

    @staticmethod
    def _resolve_task(config: EngineConfig, has_lm_head: bool) -> str:
        """--task, or the checkpoint's (pooling.detect_task); refuses what this checkpoint cannot serve. (Every task
        runs under tensor parallelism: the pooled hidden state is replicated on every rank, the LM head gathered.)"""
        task = config.task
        if task == "auto":
            task = detect_task(config.model, architectures_of(config.model), has_lm_head)
        if task != "embed" and not has_lm_head:
            raise ConfigError(
                f"this checkpoint has no LM head (lm_head.weight) and is not tied: it can embed only (--task embed), "
                f"not {task}",
                "task",
            )
        return task

    def _log_summary(self) -> None:
        """What an operator checks first: which model, how big, and how much KV room it got."""
        cfg, kv = self.config, self.kv
        log.info(
            "model %s: %s parameters (%s weights), %d layers, hidden %d, %d query / %d KV heads, context %d tokens%s, "
            "on %s",
            self.engine_config.model,
            f"{n / 1e9:.2f} B" if (n := cfg.num_parameters) >= 1e9 else f"{n / 1e6:.2f} M",
            "random" if self.engine_config.load_format == "dummy" else "checkpoint",
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            self.max_model_len,
            ""
            if (yarn := cfg.rope_scaling) is None
            else f" (YaRN x{yarn.factor:g} over {yarn.original_max_position_embeddings})",
            self.device,
        )
        tokens = kv.num_pages * kv.page_size
        graphs = self.runner.graphs
        log.info(
            "%s; KV cache %d pages x %d tokens = %d tokens (%.2f GiB), %.1f full-context requests; prefix cache %s; "
            "CUDA graphs %s",
            str(self.dtype).removeprefix("torch."),
            kv.num_pages,
            kv.page_size,
            tokens,
            kv.num_bytes / 2**30,
            tokens / self.max_model_len,
            "on" if self.cache is not None else "off",
            f"for decode batches {graphs.sizes[0]}..{graphs.max_bs} ({len(graphs.sizes)} sizes, captured in "
            f"{graphs.capture_seconds:.1f} s)"
            if graphs is not None
            else "off",
        )
        if tokens < self.max_model_len:
            log.warning(
                "the KV cache holds %d tokens, fewer than one request of the full context (%d): longer requests are "
                "refused. Give it more memory (--kv-cache-memory-fraction, --num-pages) or lower --max-model-len",
                tokens,
                self.max_model_len,
            )

    def _eagle3_head(self, spec_config: SpeculativeConfig, weights, max_num_seqs: int):
        """The EAGLE-3 head from its folder, checked against the target; the target captures its aux layers."""
        from ..model.eagle3 import Eagle3Head, load_eagle3

        try:
            head_config, head_weights = load_eagle3(
                spec_config.model,
                self.config,
                weights.embed,
                self.dtype,
                self.device,
                fp8=spec_config.quantization == "fp8",
            )
        except SpeculativeConfigError as error:
            raise ConfigError(str(error), "speculative_config") from None
        self.model.aux_layers = head_config.capture_layers
        log.info(
            "EAGLE-3 head %s: hidden %d, draft vocabulary %d, reading the target's layers %s",
            spec_config.model,
            head_config.hidden_size,
            head_config.draft_vocab_size,
            head_config.capture_layers,
        )
        # Its draft steps batch the requests that speculate (at most max_batch_size of them run at once).
        max_batch = max(1, min(spec_config.max_batch_size, max_num_seqs))
        return Eagle3Head(head_config, head_weights, self.max_model_len + MAX_SPECULATIVE_TOKENS + 1, max_batch)

    def _batch_limit(self, config: EngineConfig, page_bytes: int, parallel: ParallelGroup) -> int:
        """--max-num-seqs, or by default as many sequences as the KV pool holds at a typical length, 256 to 512
        (batch_limit.default_max_num_seqs). The pool is --num-pages when given, the CPU's default pool, or on the GPU
        the pool estimated from the memory free now (the weights loaded, nothing sized by the limit allocated yet;
        an EAGLE-3 head, loaded next, is not counted)."""
        if config.max_num_seqs is not None:
            return config.max_num_seqs
        if config.num_pages is not None:
            pages = config.num_pages
        elif self.device.type != "cuda":
            pages = _cpu_default_pages(page_bytes)
        else:
            torch.cuda.synchronize(self.device)
            free, _ = torch.cuda.mem_get_info(self.device)
            cfg = self.rank_config
            pages = estimated_pool_pages(
                free,
                config.gpu_memory_utilization,
                cfg,
                config.max_num_batched_tokens,
                page_bytes,
                ops.decode_workspace_bytes(1, cfg.num_heads),
            )
        # Every rank must schedule the same batches: the smallest pool decides.
        limit = parallel.min_int(default_max_num_seqs(pages * config.page_size, self.max_model_len))
        log.info(
            "batch limit %d sequences: the KV pool holds about %d tokens, %d sequences of %d (--max-num-seqs sets it)",
            limit,
            pages * config.page_size,
            pages * config.page_size // min(TYPICAL_SEQUENCE_TOKENS, self.max_model_len),
            min(TYPICAL_SEQUENCE_TOKENS, self.max_model_len),
        )
        return limit

    def _graph_max_bs(self, disable: bool, max_bs: int | None, max_num_seqs: int) -> int:
        """The largest decode batch to capture (--cuda-graph-max-bs, by default the batch limit); 0 = no CUDA
        graphs."""
        if max_bs is None:
            max_bs = max_num_seqs
        if disable or max_bs <= 0:
            return 0
        reason = unsupported_reason(self.model)
        if reason is not None:
            log.info("CUDA graphs off: %s", reason)
            return 0
        return min(max_bs, max_num_seqs)

    def _measure_graph_memory(self, max_bs: int, page_size: int) -> int:
        """Device memory the decode graphs take, measured by a dry capture against a one-page KV pool, then freed.

        The real graphs bake in the KV pool's addresses, so they can only be captured once the pool exists; but the
        pool is sized from the memory left, so that memory must be known first. Capturing twice costs startup
        time (logged) and gives a measured figure where an estimate could be wrong for a new model or torch.
        """
        cfg = self.rank_config
        scratch = KVPool(cfg.num_layers, 1, page_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        aux_width = len(self.model.aux_layers) * self.model.cfg.hidden_size  # (0 without an EAGLE-3 head)
        graphs = DecodeGraphs(
            self.model, scratch, self.staging, max_bs, self.sampler.graph_hook, aux_width=aux_width
        ).capture()
        used, seconds = graphs.memory_bytes, graphs.capture_seconds
        graphs.close()
        del graphs, scratch
        gc.collect()
        torch.cuda.empty_cache()
        log.info(
            "CUDA graphs: dry capture took %.2f s and %.0f MiB, set aside before sizing the KV pool",
            seconds,
            used / 2**20,
        )
        return used

    def _default_num_pages(
        self, page_bytes: int, max_tokens: int, max_seqs: int, utilization: float, graph_bytes: int = 0
    ) -> int:
        if self.device.type != "cuda":
            return _cpu_default_pages(page_bytes)
        torch.cuda.synchronize(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        # Activations of the largest step: hidden states, qkv, gate/up, and float32 logits of every sequence.
        activations = step_activation_bytes(self.rank_config, max_tokens, max_seqs)
        budget = int(free * utilization) - activations - graph_bytes
        if budget < page_bytes:
            raise RuntimeError(
                f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free after loading weights); "
                "lower max_num_batched_tokens (--max-num-batched-tokens) or max_num_seqs (--max-num-seqs), raise "
                "gpu_memory_utilization (--kv-cache-memory-fraction), or use a smaller model"
            )
        return budget // page_bytes

    # ---- the boundary: EngineRequests in, StepOutputs out (engine/messages.py) -------------------------------

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.engine_config.model,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            num_pages=self.kv.num_pages,
            page_size=self.kv.page_size,
            generation_defaults=self.generation_defaults,
            prefix_caching=self.cache is not None,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            kv_bytes=self.kv.num_bytes,
            synthetic_speculation=self.speculator is not None and self.speculator.synthetic is not None,
            tokenizer=self.engine_config.tokenizer,
            chat_template=self.engine_config.chat_template,
            task=self.task,
            hidden_size=self.config.hidden_size,
        )

    def add(self, request: EngineRequest) -> None:
        """Queue a request the frontend validated; raises InvalidRequestError (and queues nothing) if it cannot run."""
        params = request.params
        if params.max_tokens is None:
            raise InvalidRequestError("max_tokens must be set before a request reaches the engine", "max_tokens")
        check_token_ids(request.prompt_ids, self.config.vocab_size, "prompt")
        check_token_ids(params.stop_token_ids, self.config.vocab_size, "stop_token_ids")
        if params.logit_bias:
            check_token_ids(list(params.logit_bias), self.config.vocab_size, "logit_bias")
        self._check_task(request)
        req = Request(
            rid=request.rid,
            prompt_ids=list(request.prompt_ids),
            params=params,
            arrival=next(self._arrivals),
            arrival_time=request.arrival_time,
            pooling=request.pooling,
        )
        if params.structured is not None:
            self.scheduler.check_fits(req.num_prompt_tokens, params.max_tokens)
            self._compiling.append((req, self.grammars.submit(params.structured)))
            return
        self.scheduler.add(req)

    def _check_task(self, request: EngineRequest) -> None:
        """A request this engine's task serves: pooling requests of its task; generation unless it embeds (a
        reranker is a causal LM: it generates too, in the same steps as its scores)."""
        pooling = request.pooling
        if pooling is None:
            if self.task == "embed":
                raise InvalidRequestError("this model serves embeddings only (--task embed), not generation", "model")
            return
        if pooling.task != self.task:
            raise InvalidRequestError(f"this model serves {self.task}, not {pooling.task} (--task)", "model")
        if pooling.task == "score":
            if not pooling.token_ids:
                raise InvalidRequestError("a score request names the token ids it scores", "token_ids")
            check_token_ids(pooling.token_ids, self.config.vocab_size, "token_ids")
        if request.params.structured is not None:
            raise InvalidRequestError("a prefill-only request has no structured output", "response_format")

    def _admit_compiled(self) -> None:
        """Hand requests whose grammar is compiled and whose first mask is computed to the scheduler (a failed compile
        finishes its request with an error). Waits (briefly) for a compile or a mask only when there is nothing else
        to run."""
        if not self._compiling:
            return
        self._make_matchers()
        if not self.parallel.single:
            # Every rank must admit a request at the same step (their schedulers make the same choices), and compile
            # and mask times differ between processes: under tensor parallelism a step waits for the grammars it was
            # sent.
            wait([f for _, f in self._compiling])
            self._make_matchers()
            wait(mask_computations(r for r, _ in self._compiling))
        elif not self.scheduler.has_work() and self._ahead is None:
            compiles = [f for r, f in self._compiling if r.grammar is None]
            waits = compiles + mask_computations(r for r, _ in self._compiling)
            if waits:
                wait(waits, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
            self._make_matchers()
        still = []
        for request, future in self._compiling:
            if request.grammar is not None and request.grammar.ready:
                self.scheduler.add(request)
            else:
                still.append((request, future))
        self._compiling = still

    def _make_matchers(self) -> None:
        """Give each request whose compile finished its matcher (which starts computing its first mask); a request
        whose compile failed ends with an error."""
        still = []
        for request, future in self._compiling:
            if request.grammar is None and future.done():
                try:
                    request.grammar = self.grammars.matcher(future, ahead=True)
                except Exception as error:  # the frontend validated the spec; this is the tokenizer-specific rest
                    request.state, request.finish_reason = RequestState.FINISHED, FinishReason.ERROR
                    self._compile_failures.append(
                        RequestDelta(
                            rid=request.rid,
                            new_token_ids=[],
                            new_logprobs=None,
                            finish_reason="error",
                            error=str(error),
                        )
                    )
                    continue
            still.append((request, future))
        self._compiling = still

    def _schedule(self, admit: bool = True):
        """The scheduler's next batch (`admit` False: no waiting request joins it). Under tensor parallelism, only
        once every mask it could need is computed (so every rank makes the same choice); otherwise, when the only
        requests left wait for their masks, after a brief wait for the first of those."""
        scheduler = self.scheduler
        if not self.parallel.single:
            wait(mask_computations(itertools.chain(scheduler.running, scheduler.waiting)))
            return scheduler.schedule(admit)
        scheduled = scheduler.schedule(admit)
        if not scheduled.chunks:
            waits = mask_computations(itertools.chain(scheduler.running, scheduler.waiting))
            if waits:
                wait(waits, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
                scheduled = scheduler.schedule(admit)
        return scheduled

    def abort(self, rid: int) -> bool:
        """Stop a request wherever it is; its pages are released at once. False if it is unknown or finished."""
        for i, (request, _) in enumerate(self._compiling):
            if request.rid == rid:
                del self._compiling[i]
                request.state, request.finish_reason = RequestState.FINISHED, FinishReason.ABORT
                return True
        aborted = self.scheduler.abort(rid) is not None
        self._publish_cache_events()  # its computed prefix went into the cache, and no step may follow soon
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._ahead is not None or bool(self._compiling or self._compile_failures)

    def step(self) -> StepOutput:
        """One scheduler step: schedule, run the model, sample, record. A delta for every request that advanced.

        With overlap on, the step recorded here may have been launched by the previous call, and the next decode
        step is launched (when it can be chosen already) before this one's tokens are read back: the GPU runs it
        while the host records this one and returns. A verify step's drafts need this step's tokens: it is launched
        once they are recorded, before this call returns (_launch_next; docs/architecture.md says why no earlier).

        An error inside the step fails the step's requests, not the engine: each gets a delta with finish_reason
        "error", and its pages are released. A fault the engine cannot recover from (a CUDA error, a broken KV
        invariant, a failure with no request to pin it on, or MAX_FAILED_STEPS failed steps in a row) raises
        EngineFault: the process must go down so a supervisor restarts it.
        """
        self._step_requests = []
        try:
            output = self._step()
        except Exception as error:
            output = self._fail_step(error)
        else:
            self._failed_steps = 0
            if self._chooses_next_now():
                output = self._launch_next(output)
        self._publish_cache_events()
        return output

    def _chooses_next_now(self) -> bool:
        """Whether the step just recorded is followed at once, before step() returns, by the next one (the host's
        drafts for a verify step need this step's tokens, so the overlap schedule cannot launch it ahead): with the
        overlap schedule, verify graphs and speculation on, when nothing in flight already, nothing waiting could be
        admitted and every running request decodes. Its GPU work then overlaps what the caller does with this step's
        output and the start of the next call. (Under tensor parallelism every rank decides alike: none of this
        depends on timing; a mask still computed is waited for by _schedule.)"""
        scheduler, speculator = self.scheduler, self.speculator
        if not (self.overlap and self._ahead is None and self.runner.verify_graphs is not None and scheduler.running):
            return False
        if not speculator.active(len(scheduler.running)):
            return False
        # A request that could be admitted waits one step when the next verify step is armed behind the host gate:
        # that step would run anyway (cancelled, on padding, before the admission's step), so it may as well verify.
        if scheduler.admission.might_admit() and not self.runner.gate_armed:
            return False
        if any(r.uncomputed != 1 for r in scheduler.running):
            return False
        # One rank: a mask still computed would make the launch wait for it (or run the step eagerly) before this
        # step's output goes out; the next call chooses that step as before.
        return not (self.parallel.single and mask_computations(scheduler.running))

    def _launch_next(self, output: StepOutput) -> StepOutput:
        """Choose the next step now and launch it when it replays graphs; one that would run eagerly (drafts of
        several lengths, a sampler that does not fit the graphs) is launched by the next call instead, without the
        requests finished meanwhile. A failure fails the next step's requests, and their error deltas go out with
        this step's."""
        self._step_requests = list(self.scheduler.running)  # (those a failure of the scheduler's would fail)
        try:
            scheduled = self._schedule(admit=not self.runner.gate_armed)
            if not scheduled.chunks:
                self.runner.cancel_gate()
                return output
            self._step_requests = [c.request for c in scheduled.chunks]
            launched = self.runner.launch_replay(scheduled)
            self._ahead = (scheduled, launched)
            self.num_early_launches += launched is not None
            if launched is not None and scheduled.has_drafts:
                if launched.gate and self._chainable(scheduled):
                    pass  # (launched the ordinary way next, to chain behind: never behind a gate, which may time out)
                elif not self._chain_next(scheduled, launched, True):
                    self._arm_next_verify(scheduled)
        except Exception as error:
            failed = self._fail_step(error)
            return StepOutput(output.deltas + failed.deltas, failed.time, output.num_tokens)
        return output

    def _arm_next_verify(self, scheduled: ScheduledBatch) -> None:
        """Queue the verify step after the one just launched behind the host gate (ModelRunner.arm_verify), so that
        the GPU waits only for the host's drafts, not for its launch calls, when that step is most likely one of the
        same size: this step holds every running request, each has more than two steps' tokens left before
        max_tokens and the context end, nothing waits to be admitted, every row is plain (no penalties, bans,
        grammar or logprobs), and the drafter works on the host. A guess that fails (an EOS, an abort) costs one
        verify step on padding, so the engine arms only while its gates have paid lately (GateCredit); an arrival
        waits one step instead (_chooses_next_now)."""
        runner, scheduler = self.runner, self.scheduler
        # Not under tensor parallelism: a rank whose gate timed out would run its step on padding while the others
        # run theirs, and their collectives would pair the wrong steps.
        if not self.parallel.single or not runner.can_arm_verify or len(scheduled.chunks) != len(scheduler.running):
            return
        # Nor when the drafts are made on the GPU (EAGLE-3): the head's forwards would queue behind the gated step,
        # which waits for their drafts, until the gate timed out.
        if getattr(self.speculator.drafter, "drafts_on_device", False):
            return
        if not self._gate_credit.allows(runner):
            return
        if scheduler.admission.might_admit():
            return
        q = runner.verify_graphs.query_len
        for c in scheduled.chunks:
            r = c.request
            left = min(r.params.max_tokens - r.num_output_tokens, scheduler.max_model_len - len(r.token_ids))
            if left <= 2 * q or not runner.sampler.plain(r):
                return
        runner.arm_verify(runner.verify_graphs.padded_size(len(scheduled.chunks)))

    def _chain_next(self, scheduled: ScheduledBatch, launched, start: bool) -> bool:
        """Queue the verify step after `scheduled` (just launched) on the device, its inputs made there from this
        one's draws (ModelRunner.chain_verify, engine/verify_chain.py), when it is certainly the step the host would
        launch next up to what those draws decide: prompt lookup drafts (the kernel's), one rank, this step holds
        every running request with a full draft, none is paused for low acceptance, nothing waits to be admitted,
        every row is plain, each request has more than two steps' tokens left and gets pages for the longest
        outcome of both steps. `start`: `scheduled` was launched by the host. True when queued."""
        if launched.gate or not self._chainable(scheduled):
            return False
        requests = [c.request for c in scheduled.chunks]
        if not self.scheduler.reserve_ahead(requests, 2 * self.runner.verify_graphs.query_len):
            return False
        credits = [self.speculator.synthetic_credit(r) for r in requests] if start else None
        self.runner.chain_verify(launched, requests, credits)
        return True

    def _chainable(self, scheduled: ScheduledBatch) -> bool:
        """_chain_next's conditions on the step and its requests (all but the gate and the pages)."""
        runner, scheduler, speculator = self.runner, self.scheduler, self.speculator
        if runner.chain is None or len(scheduled.chunks) != len(scheduler.running) or scheduler.admission.might_admit():
            return False
        q = runner.verify_graphs.query_len
        for c in scheduled.chunks:
            r = c.request
            if r.finished or c.filled_from is not None or len(c.draft) != q - 1 or not runner.sampler.plain(r):
                return False
            left = min(r.params.max_tokens - r.num_output_tokens, scheduler.max_model_len - len(r.token_ids))
            if left <= 2 * q or not speculator.drafts_next(r):
                return False
        return True

    def _take_chained(self, scheduled: ScheduledBatch, sampled, pending) -> tuple[ScheduledBatch, object]:
        """The chained verify step that follows `scheduled` (just recorded), as the host would have scheduled it,
        from its kernel's report: each chunk at its request's last token with the draft the device made. The report's
        acceptance and last tokens must be what the host recorded (else the device and the host disagree on the
        sequence, and the step fails). Chains the step after it when it may."""
        accepted, ids = pending.chain_report.read()
        q = self.runner.verify_graphs.query_len
        chunks = []
        for b, (chunk, emitted) in enumerate(zip(scheduled.chunks, sampled)):
            request, row = chunk.request, ids[b * q : (b + 1) * q]
            if not request.finished and (accepted[b] != len(emitted) - 1 or row[0] != request.token_ids[-1]):
                raise RuntimeError(
                    f"a chained verify step disagrees with the host on request {request.rid}: the device accepted "
                    f"{accepted[b]} draft tokens and continues from token {row[0]}, the host kept "
                    f"{len(emitted) - 1} and ends at {request.token_ids[-1]}"
                )
            end = len(request.token_ids)
            chunks.append(ScheduledChunk(request, end - 1, end, tuple(row[1:])))
        following, launched = ScheduledBatch(chunks), pending.chained
        launched.requests = sampling_rows(following)
        self.num_chained_steps += 1
        self._chain_next(following, launched, False)
        return following, launched

    def _publish_cache_events(self) -> None:
        """Hand what the prefix cache stored and removed since the last call to the KV-event publisher's thread."""
        if self.kv_events is not None:
            self.kv_events.publish(self.cache.take_events())

    def _fail_step(self, error: Exception) -> StepOutput:
        failed = list({id(r): r for r in self._step_requests}.values())
        self._failed_steps += 1
        unrecoverable = _unrecoverable(error)
        if unrecoverable or not failed or self._failed_steps >= MAX_FAILED_STEPS or not self.parallel.single:
            # Under tensor parallelism the ranks must stay in step: a rank that failed may have left the others
            # inside a collective, so the whole engine goes down.
            reason = (
                "an unrecoverable error"
                if unrecoverable
                else (
                    "no request to pin it on"
                    if not failed
                    else "a failure on one rank of several"
                    if not self.parallel.single
                    else f"the {self._failed_steps}th failure in a row"
                )
            )
            raise EngineFault(f"a step failed with {reason}: {error!r}") from error
        log.error("a step failed; failing its %d requests (the engine goes on)", len(failed), exc_info=error)
        self._ahead = None  # its requests are this step's; the GPU finishes it before anything later on the stream
        message = f"the engine failed while running this request: {error!r}"
        deltas = []
        for request in failed:
            if not request.finished:
                self.scheduler.fail(request)
            deltas.append(
                RequestDelta(rid=request.rid, new_token_ids=[], new_logprobs=None, finish_reason="error", error=message)
            )
        try:
            self.check_invariants()
        except InvariantError as broken:
            raise EngineFault(f"the KV page invariant broke while failing a step: {broken}") from error
        return StepOutput(deltas, time.monotonic())

    def _step(self) -> StepOutput:
        self._admit_compiled()
        failures, self._compile_failures = self._compile_failures, []
        if self._ahead is not None:
            (scheduled, pending), self._ahead = self._ahead, None
            if pending is None:  # chosen by the last call (_launch_next), to run eagerly: without aborted requests
                scheduled = ScheduledBatch([c for c in scheduled.chunks if not c.request.finished])
            self._step_requests = [c.request for c in scheduled.chunks]
            if pending is None:
                pending = self.runner.launch(scheduled)
            if pending.deferred:  # its forward runs; its sampler needed the step just recorded (grammar masks)
                forward_done = pending.forward_done
                skipped = self.runner.mask_gate(pending.requests, lambda: not forward_done.query())
                self.runner.sample_deferred(pending, skipped)
                pending.skipped = skipped
        else:
            scheduled = self._schedule()
            self._step_requests = [c.request for c in scheduled.chunks]
            pending = self.runner.launch(scheduled)
        skipped = pending.skipped
        token_rows = list(_with_first_token_rows(scheduled))  # before skipped rows leave the batch
        dropped: set[int] = set()  # the sampling rows of the skipped chunks (a drafted chunk has several)
        if skipped:  # rows sampled without their grammar's mask: they compute that token again in a later step
            for c, row in _with_first_rows(scheduled):
                if row in skipped:
                    dropped.update(range(row, row + c.num_rows))
            scheduled = ScheduledBatch([c for c, row in _with_first_rows(scheduled) if row not in skipped])
        if self.overlap and pending.host is not None:
            following = self.scheduler.schedule_ahead(scheduled)
            if following is not None:
                launched = self.runner.launch(following, after=pending)
                if launched is not None:
                    self.num_ahead_steps += 1
                    self._ahead = (following, launched)
        tokens, logprobs = self.runner.collect(pending)
        if skipped:
            kept = [i for i in range(len(tokens)) if i not in dropped]
            tokens = [tokens[i] for i in kept]
            logprobs = None if logprobs is None else [logprobs[i] for i in kept]
        sampled = emitted_tokens(scheduled, tokens, self.speculator) if scheduled.has_drafts else tokens
        first_rows = [row for c, row in _with_first_rows(scheduled) if c.samples]
        chained = pending.chained  # a verify step made on the device from this one's draws is in flight
        advanced = self.scheduler.update(scheduled, sampled, ahead=chained is not None)
        if pending.aux_hidden is not None:  # an EAGLE-3 drafter advances over the positions the step kept
            self.speculator.observe(token_rows, pending.aux_hidden)
        if self.check_every_step:
            self.check_invariants()
        deltas = failures
        for chunk in scheduled.chunks:  # prefill-only requests this step finished (update released their pages)
            request = chunk.request
            if chunk.pools and request.pooled is not None and request.finish_reason is FinishReason.STOP:
                deltas.append(
                    RequestDelta(
                        rid=request.rid,
                        new_token_ids=[],
                        new_logprobs=None,
                        finish_reason="stop",
                        num_cached_tokens=request.num_cached_tokens,
                        first_scheduled_time=request.first_scheduled_time,
                        pooled=request.pooled,
                    )
                )
        for request, index, kept in advanced:
            finish = request.finish_reason
            row = first_rows[index]
            new_logprobs = None
            if logprobs is not None and logprobs[row] is not None:
                new_logprobs = logprobs[row : row + kept]
            deltas.append(
                RequestDelta(
                    rid=request.rid,
                    new_token_ids=request.token_ids[len(request.token_ids) - kept :],
                    new_logprobs=new_logprobs,
                    finish_reason=finish.value if finish is not None else None,
                    error=request.grammar.error
                    if finish is FinishReason.ERROR and request.grammar is not None
                    else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    first_scheduled_time=request.first_scheduled_time,
                    prompt_logprobs=self._take_prompt_logprobs(request),
                )
            )
        if chained is not None:
            self._step_requests = [c.request for c in scheduled.chunks]
            self._ahead = self._take_chained(scheduled, sampled, pending)
        return StepOutput(deltas, time.monotonic(), scheduled.num_tokens)

    @staticmethod
    def _take_prompt_logprobs(request: Request):
        """The prompt logprobs a request asked for, once, with its first token (all are computed by then)."""
        if request.params.prompt_logprobs is None or request.num_output_tokens != 1:
            return None
        taken, request.pending_prompt_logprobs = request.pending_prompt_logprobs, []
        return taken

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        spec = self.speculator.stats if self.speculator is not None else None
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(self._compiling),
            kv_usage=self.kv_usage(),
            num_preemptions=scheduler.num_preemptions,
            num_computed_tokens=scheduler.num_computed_tokens,
            num_ahead_steps=self.num_ahead_steps,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_accepted_per_position=list(spec.accepted_per_position) if spec else [],
            num_cached_pages=self.cache.num_pages if self.cache is not None else 0,
        )

    def kv_usage(self) -> float:
        """Fraction of KV pages held by requests; pages only the prefix cache holds are free on demand."""
        allocator = self.kv.allocator
        evictable = self.cache.evictable_pages() if self.cache is not None else 0
        return (allocator.num_used() - evictable) / allocator.num_total()

    def check_alive(self) -> None:
        """Raise EngineFault when the engine cannot step any more (a tensor-parallel rank is gone: see
        engine/tensor_parallel.py). One engine in one process: never."""

    def close(self) -> None:
        """Stop what the engine started besides itself: the KV-event publisher's thread (and, for
        TensorParallelEngine, the other ranks)."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def check_invariants(self) -> None:
        """Every KV page free or owned exactly by the requests that map it and the prefix cache; raises
        kvcache.InvariantError otherwise. FASTQWEN_CHECK_INVARIANTS=1 runs it after every step."""
        check_kv_invariants(self.kv.allocator, self.cache, self.scheduler.running, self.scheduler.waiting)
        check_drafter = getattr(self.speculator.drafter if self.speculator else None, "check_invariants", None)
        if check_drafter is not None:  # the EAGLE-3 head's own pool
            check_drafter(self.scheduler.running)
