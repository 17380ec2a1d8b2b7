"""EngineConfig: one definition of every engine knob, the CLI generated from it, bad values named by their flag."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest
from fastqwen.config import ConfigError, EngineConfig
from fastqwen.serve import parse_args


def _parse(argv: list[str], **defaults) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser, **defaults)
    return parser.parse_args(argv)


def test_every_field_has_a_flag_and_defaults_round_trip():
    """No flags: the config equals the dataclass's own defaults (a knob the generator misses or mistypes differs)."""
    from_cli = EngineConfig.from_cli(_parse(["--model", "m"]))
    assert from_cli == EngineConfig(model="m")
    flags = {EngineConfig.flag(f.name) for f in dataclasses.fields(EngineConfig)}
    assert len(flags) == len(dataclasses.fields(EngineConfig))


def test_flags_set_their_fields_with_the_right_types():
    argv = [
        "--model",
        "Qwen3-8B",
        "--load-format",
        "dummy",
        "--dtype",
        "half",
        "--page-size",
        "32",
        "--max-num-seqs",
        "7",
        "--max-num-batched-tokens",
        "99",
        "--max-model-len",
        "1000",
        "--num-pages",
        "12",
        "--kv-cache-memory-fraction",
        "0.5",
        "--seed",
        "3",
        "--disable-radix-cache",
        "--disable-cuda-graph",
        "--cuda-graph-max-bs",
        "8",
        "--disable-overlap-schedule",
        "--device",
        "cpu",
    ]
    config = EngineConfig.from_cli(_parse(argv))
    assert config == EngineConfig(
        model="Qwen3-8B",
        load_format="dummy",
        dtype="half",
        page_size=32,
        max_num_seqs=7,
        max_num_batched_tokens=99,
        max_model_len=1000,
        num_pages=12,
        gpu_memory_utilization=0.5,
        seed=3,
        enable_prefix_caching=False,
        disable_cuda_graph=True,
        cuda_graph_max_bs=8,
        disable_overlap_schedule=True,
        device="cpu",
    )
    # vLLM's spellings are accepted as aliases.
    alias = EngineConfig.from_cli(
        _parse(["--model", "m", "--gpu-memory-utilization", "0.3", "--no-enable-prefix-caching"])
    )
    assert alias.gpu_memory_utilization == 0.3 and alias.enable_prefix_caching is False


def test_the_batch_limits_default_to_the_pool():
    """No --max-num-seqs or --cuda-graph-max-bs: None, which the engine resolves from the KV pool
    (engine/batch_limit.py); given, the numbers."""
    config = EngineConfig.from_cli(_parse(["--model", "m"]))
    assert config.max_num_seqs is None and config.cuda_graph_max_bs is None
    given = EngineConfig.from_cli(_parse(["--model", "m", "--max-num-seqs", "512", "--cuda-graph-max-bs", "384"]))
    assert (given.max_num_seqs, given.cuda_graph_max_bs) == (512, 384)


def test_callers_override_defaults():
    config = EngineConfig.from_cli(_parse([], model="Qwen3-8B", load_format="dummy", max_model_len=4096))
    assert (config.model, config.load_format, config.max_model_len) == ("Qwen3-8B", "dummy", 4096)


@pytest.mark.parametrize(
    "field, value",
    [
        ("page_size", 3),
        ("page_size", 256),
        ("page_size", 0),
        ("max_num_seqs", 0),
        ("max_num_seqs", True),
        ("max_num_seqs", 2.5),
        ("max_num_batched_tokens", -1),
        ("max_model_len", 1),
        ("num_pages", 0),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("cuda_graph_max_bs", -1),
        ("cuda_graph_max_bs", True),
        ("cuda_graph_max_bs", "8"),
        ("load_format", "pt"),
        ("dtype", "int8"),
    ],
)
def test_bad_knobs_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError) as e:
        EngineConfig(model="m", **{field: value})
    assert e.value.field == field


def test_a_preset_needs_dummy_weights():
    with pytest.raises(ConfigError) as e:
        EngineConfig(model="Qwen3-8B")
    assert e.value.field == "load_format"
    EngineConfig(model="Qwen3-8B", load_format="dummy")


def test_build_copies_a_config_with_changes():
    base = EngineConfig(model="m", page_size=4)
    changed = EngineConfig.build(base, num_pages=9)
    assert (changed.page_size, changed.num_pages, base.num_pages) == (4, 9, None)
    assert EngineConfig.build("m", page_size=8) == EngineConfig(model="m", page_size=8)


def test_serve_takes_the_engine_flags():
    args = parse_args(["--model", "m", "--page-size", "8", "--port", "9000", "--disable-cuda-graph"])
    assert EngineConfig.from_cli(args) == EngineConfig(model="m", page_size=8, disable_cuda_graph=True)
    assert args.port == 9000


def test_serve_reports_a_bad_knob_by_its_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "fastqwen.serve", "--model", "m", "--kv-cache-memory-fraction", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--kv-cache-memory-fraction" in proc.stderr


def test_the_llm_docstring_documents_every_knob():
    """LLM(...)'s docstring lists every EngineConfig field with its help text (generated, so none can be missed)."""
    import inspect

    from fastqwen import LLM

    doc = " ".join(inspect.getdoc(LLM.__init__).split())
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":  # LLM's first argument, described in the class docstring
            continue
        assert f"{f.name} (default" in doc or f"{f.name}=" in doc, f.name
        assert " ".join(f.metadata["help"].split()) in doc, f.name
