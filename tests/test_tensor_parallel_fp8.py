"""FP8 weights under tensor parallelism on the CPU (gloo): Qwen's block-scaled FP8 checkpoint split across ranks
(each rank's rows or columns with the 128x128 scale blocks that go with them), a dense checkpoint and random weights
quantized shard by shard, a split that would cut a scale block refused, and a TP=2 FP8 engine against TP=1's.

References: the checkpoint's own e4m3 values times their block scales in float64, block by block
(checkpoints.block_dequantize_f64), sliced as sharding.py says; TP=1's quantization of each whole matrix; a TP=1 FP8
engine, teacher-forced (itself checked against Hugging Face in test_fp8_weights.py).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import engine_logits, make_checkpoint, make_fp8_checkpoint, teacher_forced_match
from fastqwen import LLM
from fastqwen.config import load_model_config
from fastqwen.sharding import Shard
from fastqwen.weights import _TensorSource, dummy_weights, load_weights

CPU = torch.device("cpu")
VOCAB = 390
NEW_TOKENS = 24
PROMPTS = [[5, 17, 200, 3], list(range(1, 30)), [300, 2, 2, 9, 41, 7, 100]]
# Every split on whole 128 blocks at TP=2 and 4: 4 query heads and 2 KV heads of 128 (TP=4 replicates each KV head on
# two ranks), intermediate 512.
SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=128, hidden=128, intermediate=512, vocab=VOCAB)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tp_fp8"))
    _, reference = make_fp8_checkpoint(folder, seed=11, **SHAPE)
    return folder, reference


def expected_shard(whole: dict[str, torch.Tensor], cfg, shard: Shard) -> dict[str, torch.Tensor]:
    """A layer's projections as rank `shard` must hold them, from the whole matrices (q, k, v, o, gate, up, down),
    sliced here as Megatron splits them: heads' rows of q/k/v and columns of o, intermediate rows of gate/up and
    columns of down."""
    d = cfg.head_dim
    (q0, q1), (k0, k1), (i0, i1) = shard.heads(cfg), shard.kv_heads(cfg), shard.intermediate(cfg)
    return {
        "qkv": torch.cat([whole["q"][q0 * d : q1 * d], whole["k"][k0 * d : k1 * d], whole["v"][k0 * d : k1 * d]]),
        "o_proj": whole["o"][:, q0 * d : q1 * d],
        "gate_up": torch.cat([whole["gate"][i0:i1], whole["up"][i0:i1]]),
        "down": whole["down"][:, i0:i1],
    }


def whole_of(layer, cfg) -> dict[str, torch.Tensor]:
    """The whole matrices of a TP=1 layer, dequantized to float64."""
    q, k, v = layer.qkv.dequantize(torch.float64).split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    gate, up = layer.gate_up.dequantize(torch.float64).chunk(2)
    o, down = layer.o_proj.dequantize(torch.float64), layer.down.dequantize(torch.float64)
    return {"q": q, "k": k, "v": v, "o": o, "gate": gate, "up": up, "down": down}


def assert_fp8_shard(layer, expected: dict[str, torch.Tensor], what: str) -> None:
    for name, want in expected.items():
        got = getattr(layer, name)
        rows, cols = want.shape
        assert got.is_fp8 and tuple(got.scale.shape) == (-(-rows // 128), -(-cols // 128)), f"{what} {name}"
        torch.testing.assert_close(got.dequantize(torch.float64), want, rtol=0, atol=0, msg=f"{what} {name}")


@pytest.mark.parametrize("size", [2, 4])
def test_fp8_checkpoint_shards_take_their_scale_blocks(fp8_checkpoint, size, monkeypatch):
    folder, reference = fp8_checkpoint
    cfg, _ = load_model_config(folder)
    read_whole = []
    get = _TensorSource.get
    monkeypatch.setattr(_TensorSource, "get", lambda self, name: read_whole.append(name) or get(self, name))
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
    names.update(gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")
    for rank in range(size):
        shard = Shard(rank, size)
        fp8 = load_weights(folder, cfg, torch.float32, CPU, fp8=True, shard=shard)
        dense = load_weights(folder, cfg, torch.float32, CPU, fp8=False, shard=shard)  # quantization "none"
        for n in range(cfg.num_layers):
            whole = {key: reference[f"model.layers.{n}.{name}.weight"] for key, name in names.items()}
            expected = expected_shard(whole, cfg, shard)
            # bf16 scales times e4m3 values are exact in float32: the very checkpoint numbers, no rounding.
            assert_fp8_shard(fp8.layers[n], expected, f"rank {rank} layer {n}")
            for name, want in expected.items():
                got = getattr(dense.layers[n], name)
                assert not got.is_fp8
                torch.testing.assert_close(got.weight.double(), want, rtol=0, atol=0, msg=f"rank {rank} {name}")
    # Weights and scales alike are read by slices: only the (replicated) norms whole.
    assert read_whole and all(name.endswith("norm.weight") for name in read_whole), read_whole


@pytest.mark.parametrize("source", ["checkpoint", "dummy"])
def test_online_quantization_is_per_shard_and_equals_the_whole_models(tmp_path, source):
    """A dense checkpoint with quantization "fp8", or random weights with fp8: each rank quantizes its own shard. With
    every split on whole 128 blocks, a block's amax is the same whether the matrix is whole or split, so each shard
    holds exactly TP=1's values and scales."""
    folder = str(tmp_path)
    make_checkpoint(folder, tied=False, seed=6, **SHAPE)
    cfg, _ = load_model_config(folder)

    def weights(shard: Shard):
        if source == "dummy":
            return dummy_weights(cfg, torch.float32, CPU, seed=9, fp8=True, shard=shard)
        return load_weights(folder, cfg, torch.float32, CPU, fp8=True, shard=shard)

    one = weights(Shard())
    for rank in range(2):
        mine = weights(Shard(rank, 2))
        for n, layer in enumerate(mine.layers):
            expected = expected_shard(whole_of(one.layers[n], cfg), cfg, Shard(rank, 2))
            assert_fp8_shard(layer, expected, f"{source} rank {rank} layer {n}")


def test_a_split_that_cuts_a_scale_block_is_refused_naming_the_projection(tmp_path):
    """Intermediate 384 at TP=2: 192 rows of gate/up a rank, half of a 128-row block scale on each side of the cut."""
    folder = str(tmp_path)
    make_fp8_checkpoint(folder, seed=2, intermediate=384)
    cfg, _ = load_model_config(folder)
    message = r"model\.layers\.0\.mlp\.gate_proj \[384, 128\] .* rank 0 of 2 .* rows \[0, 192\)"
    with pytest.raises(ValueError, match=message):
        load_weights(folder, cfg, torch.float32, CPU, fp8=True, shard=Shard(0, 2))
    with pytest.raises(ValueError, match=message):  # through the engine: the cause, not "a rank could not start"
        LLM(folder, dtype="float32", device="cpu", num_pages=64, tensor_parallel_size=2)
    load_weights(folder, cfg, torch.float32, CPU, fp8=True)  # one rank: fine


# TP=2 changes only how the float32 sums are grouped (each rank's partial o_proj and down sums, added by the
# all-reduce). Measured: TP=2 against TP=1 on this shape, checkpoint seeds 1 to 5, teacher-forced, at most 1.24e-6 of
# the largest |logit| (0.86e-6 at least). Stated tolerance: 1e-5, eight times that; a scale block off or a shard
# missing moves logits by far more.
TOLERANCE = 1e-5


def test_tp2_fp8_checkpoint_matches_tp1_teacher_forced(fp8_checkpoint):
    folder, _ = fp8_checkpoint
    knobs = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)
    single = LLM(folder, **knobs)
    references = [engine_logits(single, p, NEW_TOKENS) for p in PROMPTS]
    del single
    llm = LLM(folder, **knobs, tensor_parallel_size=2)
    try:
        weights = llm.engine.model.weights
        assert weights.layers[0].qkv.is_fp8 and weights.layers[0].down.in_features == SHAPE["intermediate"] // 2
        # Logits within the tolerance at every step, and TP=1's greedy token wherever its top-1 margin exceeds
        # twice the tolerance (on this checkpoint: every step).
        teacher_forced_match(
            llm, PROMPTS, references, TOLERANCE, min_decisive=len(PROMPTS) * NEW_TOKENS * 3 // 4, bound_forced=True
        )
    finally:
        llm.close()
