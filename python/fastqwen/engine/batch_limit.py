"""How many sequences may run at once when --max-num-seqs is not given, and the memory each of them costs besides its
KV pages. The CUDA graphs (up to --cuda-graph-max-bs, by default this limit), the staging buffer and the GPU sampler's
rows are all sized from the limit, so the rule decides them too.

The rule (`default_max_num_seqs`): as many sequences as the KV pool holds at TYPICAL_SEQUENCE_TOKENS tokens each,
rounded down to a multiple of 16 (the step between captured graph sizes past 64), never below 256 and never above 512.
- Why follow the pool: a limit the pool cannot hold buys nothing (admission stops at the free pages, and sequences
  that grow past them are preempted), while every sequence of the limit costs memory the pool then lacks
  (`per_sequence_bytes`) and graphs to capture; a limit below what the pool holds leaves throughput on the table once
  the step reads the weights once for the whole batch (batch 512 reads Qwen3-8B's 16 GB of weights once per 512
  tokens, 256 once per 256).
- Why 1,024 tokens: the length a sequence of a full batch holds while it runs, with room left. A running sequence
  holds its prompt and on average half its output (128 in / 1,024 out: 640 on average, 1,152 at the end; 512 / 512:
  768); at 1,024 a full batch of such sequences fits with room for the prefix cache and for the longer ones. With a
  shorter context than that, the context length.
- Why 256 at least: the fixed default before this rule; a smaller pool still takes up to 256 sequences, limited by its
  pages, as before.
- Why 512 at most: the largest batch the decode step has been measured and tested at (issue 47); past it every
  per-sequence buffer grows for batches nothing has checked.
By this arithmetic on an H100 (80 GB, Qwen3-8B, the default --kv-cache-memory-fraction 0.85): a bf16 pool of about
370k tokens gives about 352 sequences, an FP8 (e4m3) pool of twice the tokens 512.

On the GPU the pool is sized only after the model, the sampler and a dry capture of the graphs have taken their memory,
and they are sized from the limit; so the limit is chosen first, from the pool `estimated_pool_pages` predicts with
the largest limit's per-sequence buffers set aside. The pool itself is still sized from memory measured after all of
them are allocated (LLMEngine._default_num_pages, which counts the graphs' dry capture as measured): it differs from
the estimate by what the estimate leaves out (the capture's fixed costs, such as cuBLAS workspaces and the graphs
themselves, and buffers of a few KB per sequence) and by the buffers of the sequences a limit below 512 does not take.
"""

from __future__ import annotations

from ..config import ModelConfig

TYPICAL_SEQUENCE_TOKENS = 1024
SMALLEST_DEFAULT = 256
LARGEST_DEFAULT = 512
GRAPH_SIZE_STEP = 16  # cuda_graph.capture_sizes past 64


def default_max_num_seqs(pool_tokens: int, max_model_len: int) -> int:
    """The batch limit for a KV pool of pool_tokens tokens and this context length (the rule above)."""
    typical = min(TYPICAL_SEQUENCE_TOKENS, max_model_len)
    held = pool_tokens // typical // GRAPH_SIZE_STEP * GRAPH_SIZE_STEP
    return max(SMALLEST_DEFAULT, min(LARGEST_DEFAULT, held))


def activation_width(cfg: ModelConfig) -> int:
    """Elements of one token's activations at their widest point of a step: hidden states, qkv, gate/up."""
    return 4 * cfg.hidden_size + 2 * (cfg.q_size + 2 * cfg.kv_size) + 3 * cfg.intermediate_size


def step_activation_bytes(cfg: ModelConfig, max_tokens: int, max_seqs: int) -> int:
    """Memory the largest eager step takes beyond the pool: 16-bit activations of max_tokens tokens, and float32 logits
    of every sequence (with the sampler's temporaries: three vocabulary-wide rows each)."""
    return max_tokens * activation_width(cfg) * 2 + max_seqs * cfg.vocab_size * 4 * 3


def per_sequence_buffer_bytes(cfg: ModelConfig, decode_workspace_row: int) -> int:
    """Device memory each sequence of the limit takes in buffers allocated before the pool is sized, out of the free
    memory the memory fraction applies to: the GPU sampler's penalty-counts row (int32) and grammar-mask row (a bit per
    token), and decode_workspace_row, the decode attention's split partials (ops.decode_workspace_bytes for one
    sequence). The sampler's other per-row buffers (its scratch, about 22 KB a row for Qwen3's 151,936 tokens; logprobs
    and bans, under 2 KB) are left out: under 4% of the rest."""
    return 4 * cfg.vocab_size + cfg.vocab_size // 8 + decode_workspace_row


def per_sequence_graph_bytes(cfg: ModelConfig) -> int:
    """Device memory each sequence of the limit takes in the decode graphs, which the engine sets aside whole (their
    dry capture is measured): the float32 logits row and one row of the step's 16-bit activations (every graph shares
    the largest one's)."""
    return 4 * cfg.vocab_size + 2 * activation_width(cfg)


def estimated_pool_pages(
    free_bytes: int,
    utilization: float,
    cfg: ModelConfig,
    max_tokens: int,
    page_bytes: int,
    decode_workspace_row: int,
) -> int:
    """About the KV pages the engine will get from free_bytes (free device memory after the weights), priced as if the
    limit were LARGEST_DEFAULT: the budget LLMEngine._default_num_pages computes (the memory fraction of what is free
    once the per-sequence buffers are allocated, less the largest step's activations and the graphs), with the
    per-sequence costs estimated instead of measured (see the module's docstring for what that leaves out)."""
    largest = LARGEST_DEFAULT
    free_then = free_bytes - largest * per_sequence_buffer_bytes(cfg, decode_workspace_row)
    budget = int(free_then * utilization) - step_activation_bytes(cfg, max_tokens, largest)
    budget -= largest * per_sequence_graph_bytes(cfg)
    return max(0, budget // page_bytes)
