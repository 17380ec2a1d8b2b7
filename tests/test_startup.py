"""A server that cannot start says why and exits: non-zero, within seconds, with the cause (and the flag to change)
in its last line, whether the model source is wrong (checked before loading) or the load itself fails (in the engine
core process). And the `fastqwen` command's entry points."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from checkpoints import make_checkpoint
from safetensors.torch import save_file
from server_process import free_port

# Generous for a loaded 2-core CI machine; each case takes a few seconds alone (most of it importing torch).
DEADLINE_S = 90


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good"))
    make_checkpoint(path, tied=True, seed=3)
    return path


def _cases(root, good: str) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (arguments after `serve`, what the last line must contain)."""
    no_weights = os.path.join(root, "no_weights")
    shutil.copytree(good, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    bad_config = os.path.join(root, "bad_config")
    shutil.copytree(good, bad_config)
    with open(os.path.join(bad_config, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": 10}, f)
    corrupt = os.path.join(root, "corrupt_weights")
    shutil.copytree(good, corrupt)
    with open(os.path.join(corrupt, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    wrong_tensors = os.path.join(root, "wrong_tensors")  # readable, but not this config's tensors: fails in the core
    shutil.copytree(good, wrong_tensors)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, os.path.join(wrong_tensors, "model.safetensors"))
    return {
        "missing folder": ([os.path.join(root, "nowhere")], ["--model", "not a local path"]),
        "no weights": ([no_weights], ["--model", "no model.safetensors"]),
        "bad config": ([bad_config], ["--model", "model_type='llama'"]),
        "unknown hub id offline": (
            ["nobody-here/no-such-model"],
            ["--model", "not in the Hugging Face cache", "HF_HUB_OFFLINE"],
        ),
        "corrupt weights": (
            [corrupt],
            ["--model", "/corrupt_weights/model.safetensors is not a readable safetensors file"],
        ),
        "weights fail to load in the core": ([wrong_tensors], ["the model failed to load", "checkpoint has no tensor"]),
    }


def test_startup_failures_exit_nonzero_with_the_cause_last(tmp_path, folder):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-hub-cache")}
    started = time.monotonic()
    runs = {}
    for name, (args, _) in _cases(str(tmp_path), folder).items():  # all at once: the suite waits for the slowest
        cmd = [sys.executable, "-m", "fastqwen", "serve", *args, "--device", "cpu", "--port", str(free_port())]
        runs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for name, (_, expected) in _cases(str(tmp_path / "again"), folder).items():
        proc = runs[name]
        try:
            out, err = proc.communicate(timeout=max(1.0, DEADLINE_S - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            for p in runs.values():
                p.kill()
            pytest.fail(f"{name}: the server was still up after {DEADLINE_S} s")
        lines = [line for line in (out + err).splitlines() if line.strip()]
        assert proc.returncode not in (0, None), f"{name}: exit status {proc.returncode}\n{out}{err}"
        last = lines[-1]
        assert last.startswith("fastqwen serve: error: "), f"{name}: {last}"
        for part in expected:
            assert part in last, f"{name}: {part!r} not in the last line {last!r}"
        assert "Uvicorn running" not in out + err and "ready:" not in out + err, name
        if name == "corrupt weights":  # found before the engine starts: the one line, no traceback
            assert len(lines) == 1, lines


def test_fastqwen_command_usage(capsys):
    from fastqwen.cli import main

    assert main(["frobnicate"]) == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main([]) == 2 and "fastqwen serve MODEL" in capsys.readouterr().out


def test_config_errors_speak_in_flags(capsys):
    """Errors found before the server starts (no process needed: the same path as the cases above)."""
    from fastqwen.serve import main

    assert main(["--model", "Qwen3-0.6B"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("python -m fastqwen.serve: error: --load-format: ")
    assert main(["--model", "Qwen3-0.6B", "--load-format", "dummy", "--chat-template", "{% if %}"]) == 2
    assert "error: --chat-template: the chat template does not parse" in capsys.readouterr().err


def test_serve_and_python_m_serve_take_the_same_flags():
    from fastqwen.serve import parse_args

    flags = ["--port", "9", "--served-model-name", "a", "b", "--metrics-compat", "vllm", "--allowed-origins", "*"]
    via_cli = parse_args(["--model", "m", *flags], prog="fastqwen serve")
    assert vars(via_cli) == vars(parse_args(["--model", "m", *flags]))
    assert via_cli.served_model_name == ["a", "b"] and via_cli.allowed_origins == ["*"]
    assert parse_args(["--model", "m", "--disable-log-stats"]).stats_interval == 0


def test_parameter_count_matches_transformers():
    import torch
    from fastqwen.config import ModelConfig
    from transformers import Qwen3Config, Qwen3ForCausalLM

    for tied in (True, False):
        config = Qwen3Config(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=tied,
        )
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config)
        expected = sum(p.numel() for p in model.parameters())  # a tied head counts once
        assert ModelConfig.from_dict(config.to_dict()).num_parameters == expected
