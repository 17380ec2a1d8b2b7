"""make_engine: the engine a config asks for, the one call every entry point makes (the offline LLM, the server's
in-process thread, the engine-core process). Its own module because it sits above both kinds: LLMEngine
(llm_engine.py) and TensorParallelEngine (tensor_parallel.py, which builds on LLMEngine).

With data_parallel_size > 1 each engine-core process is one replica (engine/data_parallel.py) and builds its engine
from `replica_config`: the replica's own GPUs, and data_parallel_size 1. Anything else that is given such a config
(the offline LLM, `--engine-core thread`) runs one engine and says so instead of serving a fraction of what was asked.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..config import ConfigError, EngineConfig
from .llm_engine import LLMEngine
from .tensor_parallel import TensorParallelEngine


def make_engine(config: EngineConfig, replica: int | None = None) -> LLMEngine | TensorParallelEngine:
    """The engine for a config: one LLMEngine, or rank 0 of tensor_parallel_size ranks; with data_parallel_size > 1,
    that of data-parallel replica `replica` (given by the engine-core process that runs it)."""
    if config.data_parallel_size > 1:
        if replica is None:
            raise ConfigError(
                f"data_parallel_size={config.data_parallel_size}: this runs one engine; data parallelism is the "
                "server's (python -m fastqwen.serve --data-parallel-size N, one engine-core process per replica)",
                "data_parallel_size",
            )
        config = replica_config(config, replica)
    if config.tensor_parallel_size > 1:
        return TensorParallelEngine(config)
    return LLMEngine(config)


def replica_config(config: EngineConfig, replica: int) -> EngineConfig:
    """Replica `replica`'s config, in its own process: on CUDA, GPUs base + replica*TP .. base + replica*TP + TP-1
    (base: --device's index, else 0), the first made this process's current device; on the CPU, its share of the
    cores. Raises ConfigError naming the flag when the GPUs are not there."""
    size, tp = config.data_parallel_size, config.tensor_parallel_size
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        base, visible = device.index or 0, torch.cuda.device_count()
        if base + size * tp > visible:
            raise ConfigError(
                f"--data-parallel-size {size} x --tensor-parallel-size {tp} needs {size * tp} GPUs "
                f"(cuda:{base}..cuda:{base + size * tp - 1}); {visible} visible",
                "data_parallel_size",
            )
        device = torch.device("cuda", base + replica * tp)
        torch.cuda.set_device(device)
    else:  # the replicas share the host's cores: each spinning all of them would starve the others
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return replace(config, data_parallel_size=1, device=str(device))
