"""CUDA-graph decode: the model forward and LM head of a pure-decode step, captured once per padded batch size.

A decode step of Qwen3-8B launches about 400 kernels; eager, the launches cost more CPU time than the GPU needs at
small batches. Each captured graph reads its inputs from the staging buffer's device views for its padded size (see
staging.py) and writes float32 logits into one persistent [max_bs, vocab] buffer, so a replay is: fill the host
views, one upload, one launch. Padding rows have out_slots = -1 (their K/V are written nowhere) and kv_lens = 0
(attention reads nothing and returns zeros); their logits are computed and ignored.

A post-logits hook (logits view [size, vocab], size) is captured as a second graph per size, replayed right after the
forward's: work that turns the logits into tokens on persistent buffers (the sampler). `replay` runs both;
`replay_forward` runs the forward alone, for a step whose sampler must wait for the host (a grammar's mask needs the
token of the step before: see ModelRunner.sample_deferred) or runs eagerly; `replay_sampler` then runs the hook's
graph alone, on the logits the forward left.

All graphs share one memory pool and are captured largest first, so the smaller ones reuse the largest one's
activation memory.

With an EAGLE-3 drafter (aux_width), the forward also copies the target's hidden states at the head's layers into a
persistent buffer; the runner copies a replay's rows out right after it, on the same stream.

Speculative decoding's verify steps have graphs of their own (`query_len` = 1 + the draft length): each sequence
computes query_len tokens through the prefill attention kernel and every token gets a logits row. Their padding
sequences read the query_len first slots of page 0 (kv_lens = query_len: the causal mask of a sequence shorter than
its query is not a case the kernel serves) and write nothing.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .. import ops
from ..kvcache import KVPool
from ..model import ForwardBatch, Qwen3Model
from .staging import BatchStaging, Layout

log = logging.getLogger(__name__)

PostLogits = Callable[[torch.Tensor, int], None]


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 beyond (padding costs little next to the weight reads), with
    max_bs itself always included."""
    sizes = {1, 2, 4, *range(8, 65, 8), *range(80, max_bs + 1, 16), max_bs}
    return sorted(s for s in sizes if 1 <= s <= max_bs)


@contextmanager
def no_collection() -> Iterator[None]:
    """Around a CUDA graph capture: garbage freed during one (a dropped engine's graphs or events, kept by a reference
    cycle) makes CUDA calls that invalidate it, and torch no longer collects before capturing: collect now, none
    during."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def unsupported_reason(model: Qwen3Model) -> str | None:
    """Why this model cannot be captured (every op of the decode step must be a kernel that never syncs), or None.
    Whether each kernel applies is the ops' rule, asked of them."""
    if model.device.type != "cuda":
        return "the model is not on a GPU"
    if not ops.has_cuda_kernels():
        return "the CUDA kernels are not built or are disabled"
    dtype, head_dim = model.dtype, model.cfg.head_dim
    for name, applies in (
        ("decode attention", ops.attention_kernel_applies(True, dtype, head_dim)),
        ("qk-norm / RoPE / KV write", ops.rope_kv_kernel_applies(True, dtype, head_dim)),
        ("RMSNorm", ops.rms_norm_kernel_applies(True, dtype)),
        ("silu_and_mul", ops.silu_and_mul_kernel_applies(True, dtype)),
    ):
        if not applies:
            return f"the {name} kernel does not take {str(dtype).removeprefix('torch.')} with head_dim {head_dim}"
    if model.decode_workspace is None:
        return "the model has no decode workspace"
    return None


def fill_padding(views: dict, start: int, end: int) -> None:
    """Rows [start, end) of a decode layout become padding: write no KV, read no KV."""
    views["input_ids"][start:end] = 0
    views["positions"][start:end] = 0
    views["out_slots"][start:end] = -1
    views["kv_lens"][start:end] = 0


class DecodeGraphs:
    def __init__(
        self,
        model: Qwen3Model,
        kv: KVPool,
        staging: BatchStaging,
        max_bs: int,
        post_logits: PostLogits | None = None,
        query_len: int = 1,
        aux_width: int = 0,
    ):
        """aux_width: when non-zero, the forward also writes the hidden states at model.aux_layers of every token row
        (an EAGLE-3 drafter's input) into the persistent `aux` [max_bs x query_len, aux_width]."""
        self.query_len = query_len
        self.aux_width = aux_width
        self.aux: torch.Tensor | None = None
        self.model = model
        self.kv = kv
        self.staging = staging
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.post_logits = post_logits
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the post-logits hook's, by size
        self.logits: torch.Tensor | None = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def layout(self, size: int) -> Layout:
        """A decode layout: size sequences of query_len tokens, each token a sampling row; page-table rows as wide as
        the longest sequence."""
        q = self.query_len
        return Layout(size * q, size, size * q, self.staging.max_width)

    def fill_padding(self, views: dict, start: int, end: int) -> None:
        """Sequences [start, end) of this layout become padding."""
        q = self.query_len
        if q == 1:
            fill_padding(views, start, end)
            return
        views["input_ids"][start * q : end * q] = 0
        views["positions"][start * q : end * q] = 0
        views["out_slots"][start * q : end * q] = -1
        views["kv_lens"][start:end] = q
        views["page_table"][start:end, 0] = 0

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured size that holds batch_size sequences, or None (run eager)."""
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch a graph of this size reads: views of the staging buffer on the device."""
        v = self.staging.device_views(self.layout(size))
        return ForwardBatch(
            input_ids=v["input_ids"],
            positions=v["positions"],
            out_slots=v["out_slots"],
            query_start=v["query_start"],
            kv_lens=v["kv_lens"],
            page_table=v["page_table"],
            logits_indices=v["logits_indices"],
            is_decode=self.query_len == 1,
            max_query_len=self.query_len,
        )

    def _run(self, batch: ForwardBatch, size: int) -> None:
        rows = size * self.query_len
        aux = self.aux[:rows] if self.aux is not None else None
        self.model.forward(batch, self.kv, logits_out=self.logits[:rows], aux_out=aux)

    @torch.inference_mode()
    def capture(self) -> DecodeGraphs:
        """Capture every size; measures the time and the device memory it takes (logits buffer, pool, graphs)."""
        with no_collection():
            return self._capture_all(self.model.device)

    def _capture_all(self, device: torch.device) -> DecodeGraphs:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        q = self.query_len
        self.logits = torch.empty(self.max_bs * q, self.model.cfg.vocab_size, dtype=torch.float32, device=device)
        if self.aux_width:
            self.aux = torch.empty(self.max_bs * q, self.aux_width, dtype=self.model.dtype, device=device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            layout = self.layout(size)
            views = self.staging.host_views(layout)
            self.fill_padding(views, 0, size)  # a capture computes on padding only: no KV is written
            views["logits_indices"][:] = range(size * q)
            views["query_start"][:] = range(0, (size + 1) * q, q)
            self.staging.upload(layout)
            batch = self.batch(size)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._run(batch, size)  # warm-up outside the capture: cuBLAS settles its kernels and workspace
                if self.post_logits is not None:
                    self.post_logits(self.logits[: size * q], size * q)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._run(batch, size)
            self.graphs[size] = graph
            if self.post_logits is not None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.post_logits(self.logits[: size * q], size * q)
                self.sample_graphs[size] = graph
            torch.cuda.current_stream(device).wait_stream(stream)  # the next upload must not overtake the warm-up
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-ups' blocks in the general pool are not the graphs' memory
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        return self

    def replay(self, size: int) -> torch.Tensor:
        """Run the graphs of this padded size (forward, then the post-logits hook's) on the inputs already uploaded;
        returns logits [size, vocab]."""
        self.graphs[size].replay()
        if size in self.sample_graphs:
            self.sample_graphs[size].replay()
        return self.logits[: size * self.query_len]

    def replay_forward(self, size: int) -> torch.Tensor:
        """The forward's graph alone: logits [size x query_len, vocab], the hook not run."""
        self.graphs[size].replay()
        return self.logits[: size * self.query_len]

    def replay_sampler(self, size: int) -> None:
        """The post-logits hook's graph alone, on the logits the last forward of this size left."""
        self.sample_graphs[size].replay()

    def close(self) -> None:
        """Release the graphs and their memory (the pool goes when no graph and no tensor of it is left)."""
        for graph in [*self.graphs.values(), *self.sample_graphs.values()]:
            graph.reset()
        self.graphs.clear()
        self.sample_graphs.clear()
        self.logits = self.aux = None
