"""Tensor-parallel sharding of Qwen3, Megatron-style: which slice of every weight a rank holds.

- q/k/v and gate/up are column-parallel (each rank computes some output features: its attention heads, its part of
  the MLP's intermediate features), o_proj and down are row-parallel (each rank's partial sum; an all-reduce adds
  them).
- Attention heads are split across ranks. KV heads are split too while there are at least as many as ranks; past
  that each KV head is replicated on the ranks whose query heads read it (Qwen3-32B has 8 KV heads: TP=16 would give
  each rank one KV head shared with one other rank).
- The embedding and the LM head are vocabulary-parallel: each rank holds ceil(vocab / N) rows (the last rank's tail
  is zero padding). The embedding looks up the ids in its range and an all-reduce adds the rows; the LM head's
  logits are all-gathered.

Norm weights are replicated. Every rank then runs the same forward on its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` tensor-parallel ranks (Shard(0, 1): the whole model)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"a shard is rank 0 <= r < size, not rank {self.rank} of {self.size}")

    @property
    def whole(self) -> bool:
        return self.size == 1

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError when this model cannot be split across `size` ranks."""
        n = self.size
        problems = []
        if cfg.num_heads % n:
            problems.append(f"{cfg.num_heads} attention heads")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            problems.append(f"{cfg.num_kv_heads} KV heads (neither a multiple nor a divisor of it)")
        if cfg.intermediate_size % n:
            problems.append(f"intermediate size {cfg.intermediate_size}")
        if problems:
            raise ValueError(f"tensor parallel size {n} does not divide the model's " + ", ".join(problems))

    # ---- which rows / columns --------------------------------------------------------------------------------

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """[first, end) of this rank's query heads."""
        per = cfg.num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """[first, end) of this rank's KV heads: its share, or the one head its query heads read when there are
        fewer KV heads than ranks (that head is then replicated)."""
        if cfg.num_kv_heads >= self.size:
            per = cfg.num_kv_heads // self.size
            return self.rank * per, (self.rank + 1) * per
        head = self.rank * cfg.num_kv_heads // self.size
        return head, head + 1

    def intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        per = cfg.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_rows(self, vocab: int) -> int:
        """Rows of each rank's slice of the embedding and the LM head (the same on every rank; padded)."""
        return -(-vocab // self.size)

    def vocab(self, vocab: int) -> tuple[int, int]:
        """[first, end) of the real vocabulary rows this rank holds (end - first may be short of vocab_rows on the
        last rank, or even zero for a tiny vocabulary)."""
        rows = self.vocab_rows(vocab)
        first = min(self.rank * rows, vocab)
        return first, min(first + rows, vocab)

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as one rank sees it: its own head counts and intermediate size (the vocabulary is the whole
        one: logits are gathered before sampling)."""
        if self.whole:
            return cfg
        self.check(cfg)
        q0, q1 = self.heads(cfg)
        k0, k1 = self.kv_heads(cfg)
        i0, i1 = self.intermediate(cfg)
        return replace(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0)
