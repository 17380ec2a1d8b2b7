"""Prefill-only requests: what the engine returns instead of generated tokens, and which task a checkpoint serves.

A pooling request (Qwen3-Embedding's embeddings, Qwen3-Reranker's relevance scores) computes its prompt like any
prefill, in the same steps as generating requests, and finishes at the step that computes its last prompt token: the
model runner takes that position's final (normed) hidden state and either L2-normalizes it (embed) or projects it on
the LM head's rows of a few token ids and takes their softmax (score). It never reaches the sampler, its pages are
released when it finishes, and its result travels back in RequestDelta.pooled.

The task a server runs (EngineConfig.task, `--task`): generate, embed or score. "auto" picks it from the checkpoint,
as vLLM's runner detection does from the architecture name, plus Qwen's names for its retrieval models:
- embed: the config's architectures name a bare `*Model` (saved from transformers' Qwen3Model: no LM head), or the
  checkpoint has no LM head at all, or the model's name contains "Embedding" (Qwen3-Embedding checkpoints say
  Qwen3ForCausalLM in their config);
- score: the model's name contains "Reranker" (Qwen3-Reranker is a plain Qwen3ForCausalLM used as a yes/no judge);
- generate otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

TASKS = ("auto", "generate", "embed", "score")


@dataclass
class PoolingParams:
    """task "embed": the last position's final hidden state, L2-normalized (the whole vector: the frontend truncates
    it to `dimensions` and normalizes again). task "score": the softmax over the logits of `token_ids` at the last
    position (Qwen3-Reranker: ["yes", "no"], the first probability is the relevance score)."""

    task: str
    token_ids: list[int] = field(default_factory=list)


def detect_task(model: str, architectures: list[str], has_lm_head: bool) -> str:
    """The task of a checkpoint when --task is auto (module docstring); `model` is its folder or hub id."""
    name = os.path.basename(os.path.normpath(model)).lower()
    if "snapshots" in model:  # a hub cache folder: models--Qwen--Qwen3-Embedding-0.6B/snapshots/<hash>
        name = model.lower()
    if any(a.endswith("Model") for a in architectures) or not has_lm_head or "embedding" in name:
        return "embed"
    if "reranker" in name:
        return "score"
    return "generate"


def architectures_of(model: str) -> list[str]:
    """The `architectures` of a checkpoint folder's config.json ([] for a preset or a config without them)."""
    config_file = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(config_file):
        return []
    with open(config_file) as f:
        return list(json.load(f).get("architectures") or [])
