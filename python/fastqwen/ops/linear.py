"""Linear layers: one weight container (`LinearWeight`) and one dispatch (`linear`) for every projection and the LM head.

A weight is dense (the model's dtype) or FP8 weight-only: float8_e4m3fn values with float32 dequantization scales on
128x128 blocks (Qwen's official FP8 layout: `weight_scale_inv[row // 128, col // 128]` multiplies the block), so that
`W ~= weight.float() * scale` blockwise. Dispatch, for y = x @ W^T (+ bias):

- few tokens (DENSE_GEMV_MAX_TOKENS, FP8_GEMV_MAX_TOKENS: decode) on the GPU: the hand-written GEMV kernels, which
  stream each weight byte once: one token with FMAs (csrc/gemv.cu: FP8 dequantized in registers, bf16 activations,
  fp32 accumulation), 2 to 8 on the tensor cores (csrc/gemv_tc.cu: fp32 accumulation; FP8 weights meet x in f16,
  each warp's share of a token scaled by a power of two into f16's range);
- more tokens, dense: cuBLAS through torch;
- more tokens, FP8: an FP8 tensor-core GEMM through `torch.nn.functional.scaled_mm` with per-token activation scales
  on 1x128 groups and the weight's 128x128 block scales, where this torch and GPU support that scaling (probed once);
  otherwise the stated fallback: dequantize the weight to the activation dtype and run the cuBLAS GEMM;
- anywhere else (CPU, no kernels): `linear_reference`, which dequantizes and multiplies in float32.

`linear_silu_and_mul` is the MLP's gate and up projections with its activation: where the GEMV runs, the kernel
multiplies silu(gate) by up in its epilogue (no activation kernel, no 2d-wide intermediate); elsewhere `linear` then
`silu_and_mul`, with the same bits.
At one token the RMSNorm between two projections can ride on their GEMVs: `linear_add_residual` adds the projection
before the norm into the residual, and `linear(residual, w, norm=(weight, eps))` (or `linear_silu_and_mul`'s)
normalizes the residual as it reads it. The decode step at batch 1 then runs no norm kernel.

Sharding for tensor parallelism slices these containers along their rows or columns; it lives elsewhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._native import check_tensors, dtype_code, import_error, kernel_applies, native, stream_of
from .activation import silu_and_mul

__all__ = [
    "FP8_BLOCK",
    "FP8_MAX",
    "GEMV_MAX_TOKENS",
    "GemvEpilogue",
    "LinearWeight",
    "dequantize_fp8",
    "gemv",
    "gemv_kernel_applies",
    "linear",
    "linear_add_residual",
    "linear_reference",
    "linear_silu_and_mul",
    "norm_in_gemv_applies",
    "prepare_linear",
    "quantize_fp8",
]

log = logging.getLogger(__name__)


def _exported(name: str):
    """A contract of the kernels, defined once in csrc/ and exported by fastqwen._C in every build (the host-only one
    too)."""
    module = native()
    if module is None:
        raise ImportError(
            f"fastqwen._C is not importable ({import_error()}), and {name} comes from it: reinstall "
            "with `pip install .`"
        )
    return getattr(module, name)


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# Scale granularity: one float32 scale per FP8_BLOCK x FP8_BLOCK block of the weight (csrc/gemv.h, kGemvFp8Block).
FP8_BLOCK: int = _exported("GEMV_FP8_BLOCK")
# The most tokens (rows of x) one GEMV call takes (csrc/gemv.h, kGemvMaxTokens).
GEMV_MAX_TOKENS: int = _exported("GEMV_MAX_TOKENS")
# What the one-token GEMV does besides x @ W^T (csrc/gemv.h): PLAIN, ADD_RESIDUAL, NORM_X, NORM_X_FOLDED.
GemvEpilogue = _exported("GemvEpilogue")
# Dispatch policy, not a kernel fact (so it is Python's): the most tokens linear() gives the GEMV rather than cuBLAS
# (or the FP8 GEMM) above. One token runs the FMA kernel (csrc/gemv.cu), 2 to 8 its tensor-core kernel
# (csrc/gemv_tc.cu), whose cost hardly grows with the tokens. Chosen from bench/bench_gemv.py on the H100
# (git show 1274b3f:bench/results/2026-11-23-h100-gemv-tc/run4, Qwen3-8B shapes): dense, the GEMV beats cuBLAS at 1, 2, 4 and 8 tokens
# on every projection and the LM head (at 8: qkv 19.9 against 21.6 us, gate_up 72.0 against 75.9, down 39.6 against
# 42.2); FP8, it beats the block-scaled GEMM (with the fused activation quantizer) at 1 and 2 tokens, by 3% over a
# layer's four projections at 4, and loses by 40% at 8. Both stay within the kernels' limits, GEMV_MAX_TOKENS and
# the tensor-core kernel's _C.GEMV_TENSOR_CORE_TOKENS (tests/test_native_contracts.py checks).
DENSE_GEMV_MAX_TOKENS = 8
FP8_GEMV_MAX_TOKENS = 4


@dataclass
class LinearWeight:
    """A projection's weight [out, in] (dense, or float8_e4m3fn with `scale`), and its optional bias [out]."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None  # FP8 only: float32 [ceil(out / 128), ceil(in / 128)]
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.weight.dim() != 2:
            raise ValueError(f"LinearWeight: weight must be 2-D [out, in], got shape {tuple(self.weight.shape)}")
        rows, cols = self.weight.shape
        if self.is_fp8:
            want = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
            if self.scale is None or tuple(self.scale.shape) != want or self.scale.dtype != torch.float32:
                got = None if self.scale is None else (tuple(self.scale.shape), self.scale.dtype)
                raise ValueError(
                    f"LinearWeight: an FP8 weight [{rows}, {cols}] needs float32 block scales {want}, got {got}"
                )
        elif self.scale is not None:
            raise ValueError(f"LinearWeight: a {self.weight.dtype} weight takes no scale")
        if self.bias is not None and tuple(self.bias.shape) != (rows,):
            raise ValueError(f"LinearWeight: bias must be [{rows}], got {tuple(self.bias.shape)}")
        self._scaled_mm_scale: torch.Tensor | None = None  # the scale in the layout scaled_mm wants, made on first use

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def to_fp8(self) -> LinearWeight:
        """This projection quantized to FP8 (quantize_fp8: 128x128 block scales), its bias kept."""
        return LinearWeight(*quantize_fp8(self.weight), self.bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense [out, in] tensor of `dtype` (dequantized in float32, then rounded once)."""
        if not self.is_fp8:
            return self.weight.to(dtype)
        return dequantize_fp8(self.weight, self.scale).to(dtype)

    def tensors(self):
        yield self.weight
        for t in (self.scale, self.bias):
            if t is not None:
                yield t


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] from e4m3 values and their 128x128 block scales."""
    return weight.float() * _expand_blocks(scale.float(), *weight.shape)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [out, in] weight to (float8_e4m3fn values, float32 [ceil(out/128), ceil(in/128)] scales), one scale
    per 128x128 block: amax / 448, so that the block's largest magnitude maps to e4m3's largest finite value. Each
    dequantized element is within half an e4m3 step (relative 2^-4) of the input, or 2^-9 * scale near zero."""
    rows, cols = weight.shape
    w = weight.float()
    pr, pc = -(-rows // FP8_BLOCK) * FP8_BLOCK, -(-cols // FP8_BLOCK) * FP8_BLOCK
    padded = F.pad(w, (0, pc - cols, 0, pr - rows))
    blocks = padded.view(pr // FP8_BLOCK, FP8_BLOCK, pc // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand_blocks(scale, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def linear_reference(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """The PyTorch reference: dequantize, multiply in float32, add the bias, round once to x's dtype."""
    y = x.float() @ w.dequantize(torch.float32).t()
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(x.dtype)


def _gemv_fits(x: torch.Tensor, w: LinearWeight, max_tokens: int) -> bool:
    if x.dim() != 2 or not (0 < x.shape[0] <= max_tokens) or x.shape[1] != w.in_features:
        return False
    if not kernel_applies("gemv", x.is_cuda, x.dtype):
        return False
    return (w.is_fp8 or w.weight.dtype == x.dtype) and w.in_features % 16 == 0


def gemv_kernel_applies(x: torch.Tensor, w: LinearWeight) -> bool:
    """Whether linear(x, w) runs the GEMV kernel: a CUDA tensor of bf16/fp16 with at most DENSE_GEMV_MAX_TOKENS rows
    (FP8_GEMV_MAX_TOKENS for an FP8 weight), a weight whose row length suits 16-byte loads, the kernels built; above
    one token, only where its tensor-core kernel takes the call (the FMA kernel then loses to the GEMMs)."""
    if not _gemv_fits(x, w, FP8_GEMV_MAX_TOKENS if w.is_fp8 else DENSE_GEMV_MAX_TOKENS):
        return False
    return x.shape[0] == 1 or native().gemv_uses_tensor_cores(x.shape[0], w.in_features, w.is_fp8)


def gemv(x: torch.Tensor, w: LinearWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMV kernel itself at any token count it takes (1 to GEMV_MAX_TOKENS), whatever linear() would pick: for
    tests and benchmarks. ValueError where the kernel does not apply."""
    if not _gemv_fits(x, w, GEMV_MAX_TOKENS):
        raise ValueError(
            f"gemv: the kernel does not apply to x {tuple(x.shape)} {x.dtype} on {x.device} and a "
            f"{w.weight.dtype} weight {tuple(w.weight.shape)}"
        )
    if out is None:
        out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
    return _gemv(x.contiguous(), w, out)


def _gemv(x: torch.Tensor, w: LinearWeight, out: torch.Tensor, silu_gate_up: bool = False) -> torch.Tensor:
    check_tensors("linear", x.device, None, x=x, weight=w.weight, out=(out, x.dtype))
    scale = w.scale if w.is_fp8 else None
    bias = w.bias
    if scale is not None:
        check_tensors("linear", x.device, torch.float32, scale=scale)
    if bias is not None:
        check_tensors("linear", x.device, x.dtype, bias=bias)
    width = w.out_features // 2 if silu_gate_up else w.out_features
    if tuple(out.shape) != (x.shape[0], width):
        raise ValueError(f"linear: out must be [{x.shape[0]}, {width}], got {tuple(out.shape)}")
    native().gemv(_gemv_args(x, w, out, silu_gate_up))
    return out


def _gemv_args(x: torch.Tensor, w: LinearWeight, out: torch.Tensor, silu_gate_up: bool):
    """The fields of csrc/gemv.h's GemvArgs that gemv and gemv_norm both take (epilogue PLAIN)."""
    args = native().GemvArgs()
    args.out, args.x, args.w = out.data_ptr(), x.data_ptr(), w.weight.data_ptr()
    args.scale = w.scale.data_ptr() if w.is_fp8 else 0
    args.bias = 0 if w.bias is None else w.bias.data_ptr()
    args.m, args.n, args.k = x.shape[0], w.out_features, w.in_features
    args.dtype, args.fp8, args.silu_gate_up = dtype_code(x.dtype), w.is_fp8, silu_gate_up
    args.stream = stream_of(x)
    return args


# ---- FP8 GEMM for many tokens -------------------------------------------------------------------------------------

_scaled_mm_ok: bool | None = None  # decided on first use: does this torch + GPU run 1x128 x 128x128 block scaling


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 [M, K], float32 scales [M, K/128]), one scale per token and 128 columns."""
    m, k = x.shape
    groups = x.float().view(m, k // FP8_BLOCK, FP8_BLOCK)
    amax = groups.abs().amax(dim=2, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, k)
    return q, scale.view(m, k // FP8_BLOCK)


def _scaled_mm_weight_scale(w: LinearWeight) -> torch.Tensor:
    """The block scales as scaled_mm takes them for the [K, N] operand: [round_up(K/128, 4), N/128], stride [1, L4]."""
    if w._scaled_mm_scale is None:
        nb, kb = w.scale.shape
        l4 = -(-kb // 4) * 4
        padded = torch.zeros(nb, l4, dtype=torch.float32, device=w.scale.device)
        padded[:, :kb] = w.scale
        w._scaled_mm_scale = padded.t()
    return w._scaled_mm_scale


def quantized_buffers(padded: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the CUDA kernels write activations quantized for the block-scaled FP8 GEMM (csrc/fp8_quant.h): q e4m3
    [padded, k] and scale_t float32 [k / 128, padded] (QuantizedRows.scale is its transpose)."""
    q = torch.empty(padded, k, dtype=FP8_DTYPE, device=device)
    return q, torch.empty(k // FP8_BLOCK, padded, dtype=torch.float32, device=device)


def _quantize_for_gemm(x: torch.Tensor, padded: int, silu_gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [padded, K], float32 scales [padded, K/128] with stride [1, padded]); rows past x's are zero.
    silu_gate_up: x is [M, 2K] (gate, up) and what is quantized is silu_and_mul(x), bit for bit."""
    m, k = x.shape
    if silu_gate_up:
        k //= 2
    if kernel_applies("quantize_fp8_tokens", x.is_cuda, x.dtype) and padded <= 65535:
        q, scale_t = quantized_buffers(padded, k, x.device)
        check_tensors("linear", x.device, None, x=x)
        native().quantize_fp8_tokens(
            q.data_ptr(),
            scale_t.data_ptr(),
            x.data_ptr(),
            m,
            padded,
            k,
            dtype_code(x.dtype),
            stream_of(x),
            silu_gate_up,
        )
        return q, scale_t.t()
    if silu_gate_up:
        x = silu_and_mul(x)
    q, sx = quantize_activations(F.pad(x, (0, 0, 0, padded - m)))
    scale_a = torch.empty_strided(sx.shape, (1, padded), dtype=torch.float32, device=x.device)
    return q, scale_a.copy_(sx)


@dataclass(frozen=True)
class QuantizedRows:
    """Activations already quantized for the block-scaled FP8 GEMM (what _fp8_gemm would quantize them to):
    q e4m3 [padded, K], scale float32 [padded, K/128] with stride [1, padded], of which `rows` are real; dtype is
    the activations' own (the GEMM's output). linear() takes them for an FP8 weight on the GEMM path."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype

    @property
    def in_features(self) -> int:
        return self.q.shape[1]


def _padded_rows(m: int) -> int:
    return -(-m // 16) * 16  # cuBLASLt refuses block-scaled GEMMs whose token count (scale_a's stride) is unaligned


def _fp8_gemm(x: torch.Tensor | QuantizedRows, w: LinearWeight) -> torch.Tensor:
    if not isinstance(x, QuantizedRows):
        x = QuantizedRows(*_quantize_for_gemm(x.contiguous(), _padded_rows(x.shape[0])), x.shape[0], x.dtype)
    y = F.scaled_mm(
        x.q,
        w.weight.t(),
        x.scale,
        F.ScalingType.BlockWise1x128,
        _scaled_mm_weight_scale(w),
        F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )[: x.rows]
    return y if w.bias is None else y + w.bias


def silu_and_mul_quantized(gate_up: torch.Tensor) -> QuantizedRows:
    """silu_and_mul(gate_up) quantized for the block-scaled FP8 GEMM in one pass, the [M, d] activations never
    written out (the quantizer's silu_gate_up form; bit for bit _fp8_gemm's quantization of silu_and_mul(gate_up)).
    gate_up: [M, 2d], d a multiple of 128."""
    m, two_d = gate_up.shape
    if two_d % (2 * FP8_BLOCK):
        raise ValueError(f"silu_and_mul_quantized: gate_up must be [M, 2d] with d a multiple of 128, got {two_d}")
    q, scale = _quantize_for_gemm(gate_up.contiguous(), _padded_rows(m), silu_gate_up=True)
    return QuantizedRows(q, scale, m, gate_up.dtype)


def fp8_gemm_supported(device: torch.device, dtype: torch.dtype, w: LinearWeight) -> bool:
    """Whether the tensor-core FP8 GEMM runs here: shapes in whole 128 blocks and a torch/GPU that accepts the
    block scaling (tried once on a small problem; a failure is logged and the dequantize fallback used)."""
    global _scaled_mm_ok
    if not (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)):
        return False
    if w.in_features % FP8_BLOCK or w.out_features % FP8_BLOCK:
        return False
    if _scaled_mm_ok is None:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            probe = LinearWeight(*quantize_fp8(torch.randn(384, 640, device=device, generator=gen)))
            errors = []
            for tokens in (17, 64, 301):  # token counts that are and are not multiples of the alignment
                probe_x = torch.randn(tokens, 640, device=device, dtype=dtype, generator=gen)
                got = _fp8_gemm(probe_x, probe).float()
                want = linear_reference(probe_x, probe).float()
                errors.append(((got - want).norm() / want.norm()).item())
            _scaled_mm_ok = max(errors) < 0.1
            if not _scaled_mm_ok:
                log.warning("FP8 block-scaled GEMM gives wrong results here; FP8 prefill dequantizes instead")
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as e:
            log.warning(
                "FP8 block-scaled GEMM (scaled_mm 1x128 x 128x128) unavailable (%s); FP8 prefill and large "
                "batches dequantize the weight and run a bf16 GEMM instead",
                str(e).splitlines()[0],
            )
            _scaled_mm_ok = False
    return _scaled_mm_ok


def norm_in_gemv_applies(dtype: torch.dtype, device: torch.device, weights: list[LinearWeight]) -> bool:
    """Whether the one-token GEMV, and with it the norm it can carry, runs every one of these weights for a token of
    dtype on device."""
    rows = [torch.empty(1, w.in_features, dtype=dtype, device=device) for w in weights]
    return all(_gemv_fits(x, w, 1) for x, w in zip(rows, weights)) and hasattr(native(), "gemv_norm")


def _gemv_norm(
    epilogue,
    x: torch.Tensor,
    w: LinearWeight,
    out: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu_gate_up: bool = False,
    send: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The one-token GEMV with a GemvEpilogue other than PLAIN (csrc/gemv.h, gemv_norm). send: (target, capacity)
    of the SEND epilogue."""
    if not _gemv_fits(x, w, 1):
        raise ValueError(
            f"linear (norm in the GEMV): the one-token GEMV does not apply to x {tuple(x.shape)} "
            f"{x.dtype} on {x.device} and a {w.weight.dtype} weight {tuple(w.weight.shape)}"
        )
    check_tensors("linear", x.device, None, x=x, weight=w.weight, out=(out, x.dtype))
    if norm_weight is not None:
        check_tensors("linear", x.device, x.dtype, norm_weight=norm_weight)
        if norm_weight.numel() != w.in_features:
            raise ValueError(f"linear: the norm weight must have {w.in_features} elements, got {norm_weight.numel()}")
    width = w.out_features // 2 if silu_gate_up else w.out_features
    if tuple(out.shape) != (1, width):
        raise ValueError(f"linear: out must be [1, {width}], got {tuple(out.shape)}")
    args = _gemv_args(x, w, out, silu_gate_up)
    args.epilogue, args.eps = epilogue, eps
    args.norm_weight = 0 if norm_weight is None else norm_weight.data_ptr()
    if send is not None:
        args.send, args.send_capacity = send
    native().gemv_norm(args)
    return out


def linear_add_residual(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor) -> torch.Tensor:
    """One token, the projection before an RMSNorm (the one-token GEMV; ValueError where it does not run): residual
    [1, out] += x @ W^T, rounded as linear then fused_add_rms_norm round it. The norm itself is left to the next
    projection (`linear(residual, w, norm=...)`). Under programmatic launch the kernel may read the residual before
    it waits for the kernel before it, which therefore must not write the residual."""
    return _gemv_norm(GemvEpilogue.ADD_RESIDUAL, x.contiguous(), w, residual)


def linear_send(x: torch.Tensor, w: LinearWeight, target: int, capacity: int) -> torch.Tensor:
    """One token, the projection before a tensor-parallel all-reduce (o_proj, down; the one-token GEMV, ValueError
    where it does not run): y = x @ W^T, rounded as linear rounds it, is not written out but stored into this rank's
    slot of every rank's receive buffer of the coming round (target: CustomAllReduce.send_target; capacity: its
    send_capacity elements). Returns a new [1, out] tensor that holds nothing yet: where
    CustomAllReduce.all_reduce_add_rms_norm(..., sent=True), which must come next, writes its normalized rows."""
    out = torch.empty(1, w.out_features, dtype=x.dtype, device=x.device)
    return _gemv_norm(GemvEpilogue.SEND, x.contiguous(), w, out, send=(target, capacity))


def _norm_epilogue(norm: tuple[torch.Tensor | None, float]):
    """NORM_X for norm = (weight, eps); NORM_X_FOLDED for (None, eps), the weight already in W's columns."""
    return GemvEpilogue.NORM_X if norm[0] is not None else GemvEpilogue.NORM_X_FOLDED


def prepare_linear(weights, dtype: torch.dtype, device: torch.device) -> None:
    """Called once before any step (and before CUDA graphs are captured, where nothing may synchronize or allocate
    for later): probes the FP8 GEMM and lays out the block scales it takes, for every FP8 weight in `weights`."""
    for w in weights:
        if w.is_fp8 and fp8_gemm_supported(device, dtype, w):
            _scaled_mm_weight_scale(w)


def quantized_input_applies(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, w: LinearWeight | None
) -> bool:
    """Whether linear(x, w) for x of this shape, dtype and device runs the block-scaled FP8 GEMM with the CUDA
    quantizer (so that QuantizedRows made beforehand can stand for x): a weight (None: no), x [rows, w.in_features],
    an FP8 weight, more tokens than the FP8 GEMV takes, the GEMM and the quantizer here."""
    if w is None or len(shape) != 2 or shape[1] != w.in_features:
        return False
    rows = shape[0]
    return (
        w.is_fp8
        and FP8_GEMV_MAX_TOKENS < rows
        and _padded_rows(rows) <= 65535
        and kernel_applies("quantize_fp8_tokens", device.type == "cuda", dtype)
        and fp8_gemm_supported(device, dtype, w)
    )


def linear_silu_and_mul(
    x: torch.Tensor | QuantizedRows,
    w: LinearWeight,
    gemv_only: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    quantize_for: LinearWeight | None = None,
) -> torch.Tensor | QuantizedRows:
    """silu_and_mul(linear(x, w)) for w the gate and up projections stacked ([gate; up], as Qwen3's MLP keeps them):
    [M, out / 2]. Where linear would run the GEMV, one GEMV kernel computes both halves and multiplies them in its
    epilogue, bit for bit what the two ops give. gemv_only: the GEMV at any token count it takes (tests, benchmarks;
    ValueError where it does not apply). norm: as for `linear`.
    quantize_for (the down projection's weight): where linear(result, quantize_for) would quantize the result for
    the block-scaled FP8 GEMM (quantized_input_applies), the activation is quantized as silu_and_mul computes it
    (silu_and_mul_quantized) and QuantizedRows returned: bit for bit the same GEMM inputs, without writing the
    [M, out / 2] activations and reading them back. x may be QuantizedRows (the norm before quantized its rows for
    this GEMM: ops.fused_add_rms_norm_quantized)."""
    if w.out_features % 2 != 0:
        raise ValueError(f"linear_silu_and_mul: the weight must stack gate and up (even rows), got {w.out_features}")
    if isinstance(x, QuantizedRows):
        y = linear(x, w)
        quantize = quantized_input_applies((x.rows, w.out_features // 2), x.dtype, y.device, quantize_for)
        return silu_and_mul_quantized(y) if quantize else silu_and_mul(y)
    if (
        norm is None
        and not gemv_only
        and x.dim() == 2
        and quantized_input_applies((x.shape[0], w.out_features // 2), x.dtype, x.device, quantize_for)
        and not gemv_kernel_applies(x, w)
    ):
        return silu_and_mul_quantized(linear(x, w))
    if norm is not None:
        out = torch.empty(1, w.out_features // 2, dtype=x.dtype, device=x.device)
        return _gemv_norm(_norm_epilogue(norm), x.contiguous(), w, out, *norm, silu_gate_up=True)
    fits = _gemv_fits(x, w, GEMV_MAX_TOKENS) if gemv_only else gemv_kernel_applies(x, w)
    if fits:
        out = torch.empty(x.shape[0], w.out_features // 2, dtype=x.dtype, device=x.device)
        return _gemv(x.contiguous(), w, out, silu_gate_up=True)
    if gemv_only:
        raise ValueError(f"linear_silu_and_mul: the GEMV does not apply to x {tuple(x.shape)} {x.dtype} on {x.device}")
    return silu_and_mul(linear(x, w))


def linear(
    x: torch.Tensor, w: LinearWeight, out: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [M, in] -> [M, out] of x's dtype; into `out` when given (and the GEMV runs).
    norm = (weight, eps): x is one token's residual and y = RMSNorm(x) @ W^T (+ bias), the norm done by the one-token
    GEMV as it reads x (products and sums fp32, the normalized row never rounded; ValueError where it does not run).
    norm = (None, eps): the same where the norm's weight is already multiplied into W's columns (weights.fold_norm).
    x may be QuantizedRows (linear_silu_and_mul's or norm.fused_add_rms_norm_quantized's, made for an FP8 w where
    quantized_input_applies): the FP8 GEMM on them."""
    if isinstance(x, QuantizedRows):
        if norm is not None or not w.is_fp8 or x.in_features != w.in_features:
            raise ValueError(
                f"linear: quantized rows of {x.in_features} columns take an FP8 weight of as many in-features and no "
                f"norm, got a {w.weight.dtype} weight of {w.in_features}"
            )
        y = _fp8_gemm(x, w)
        return y if out is None else out.copy_(y)
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"linear: x must be [tokens, {w.in_features}], got {tuple(x.shape)}")
    if norm is not None:
        out = torch.empty(1, w.out_features, dtype=x.dtype, device=x.device) if out is None else out
        return _gemv_norm(_norm_epilogue(norm), x.contiguous(), w, out, *norm)
    if gemv_kernel_applies(x, w):
        return gemv(x, w, out)
    if not w.is_fp8 and w.weight.dtype == x.dtype:
        y = F.linear(x, w.weight, w.bias)
    elif w.is_fp8 and x.is_cuda and fp8_gemm_supported(x.device, x.dtype, w):
        y = _fp8_gemm(x, w)
    elif w.is_fp8 and x.is_cuda:
        y = F.linear(x, w.dequantize(x.dtype), w.bias)  # the stated fallback: one dequantized copy per call
    else:
        y = linear_reference(x, w)
    return y if out is None else out.copy_(y)
