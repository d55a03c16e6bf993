"""MXFP4 expert weights as OpenAI publishes GPT-OSS: each ``<name>_blocks`` [E, rows, G, 16] (uint8) packs two 4-bit
e2m1 values per byte (the low nibble first) for G groups of 32 values per row, ``<name>_scales`` [E, rows, G]
(uint8) one shared e8m0 scale per group (2^(s - 127)); config.json's ``quantization_config`` says ``quant_method:
mxfp4``. The rows are the output features, so a tensor reads back as [E, rows, G * 32] and is handed on transposed,
[E, in, out], as transformers holds ``gate_up_proj`` / ``down_proj``. Import reads them dequantized, in fp32;
``export hf --mxfp4`` (and ``export trt`` of GPT-OSS) writes them back in this layout (``encode_mxfp4``)."""

from __future__ import annotations

from typing import Any

import torch

from megapipe.errors import MegapipeError

BLOCKS, SCALES = "_blocks", "_scales"
# e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 the same negated
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between neighbouring e2m1 magnitudes; at the ones whose lower code is odd a tie rounds up (to even)
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
TIES_UP = (0.75, 1.75, 3.5)
# what the published checkpoints pack: the experts' weight matrices (their biases stay bf16)
PACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# the published gpt-oss config's quantization_config (transformers' Mxfp4Config replaces the experts only)
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def is_mxfp4(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, B] uint8, scales [..., G] uint8 -> fp32 [..., G * 2B] (value 2j: byte j's low nibble)."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).to(torch.long)  # [..., G, B, 2]
    values = table[codes].flatten(-2)  # [..., G, 2B]
    values = values * torch.exp2(scales.to(torch.float32) - 127)[..., None]
    return values.flatten(-2)


def encode_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp [..., G * 32] -> (blocks [..., G, 16], scales [..., G]) uint8, read back by ``decode_mxfp4``.

    Each group's scale is the smallest power of two 2^e with max|x| <= 6 * 2^e (nothing saturates; e within e8m0's
    [-127, 127]); each x / 2^e rounds to the nearest e2m1 value, ties to the even code, its sign kept (-0 too). So
    |x - decoded| <= 2^e / 4 where |x| <= 2^(e+1), 2^e / 2 where |x| <= 2^(e+2), 2^e above: at most max|x| / 3.
    Decoded MXFP4 comes back byte for byte where each group's largest code is 4 or 6 (the form this rule writes):
    decode is not one-to-one otherwise (a group whose largest value is 3 * 2^k reads as 6 * 2^(k-1) does)."""
    x = values.to(torch.float32).contiguous().unflatten(-1, (-1, 32))
    if not torch.isfinite(x).all():
        raise MegapipeError("MXFP4 cannot encode a non-finite weight (inf or nan)")
    mantissa, exponent = torch.frexp(x.abs().amax(-1))  # max|x| = m * 2^p, m in [0.5, 1)
    e = (exponent - 3 + (mantissa > 0.75).to(exponent.dtype)).clamp(-127, 127)  # 6 * 2^(p-3) = 0.75 * 2^p
    q = x.abs() * torch.exp2(-e.to(torch.float32))[..., None]
    midpoints, ties = (torch.tensor(t, dtype=torch.float32, device=x.device) for t in (MIDPOINTS, TIES_UP))
    codes = (torch.bucketize(q, midpoints) + torch.isin(q, ties)).clamp(max=7)
    codes = (codes | (torch.signbit(x).to(codes.dtype) << 3)).to(torch.uint8).unflatten(-1, (16, 2))
    return codes[..., 0] | (codes[..., 1] << 4), (e + 127).to(torch.uint8)


def is_packed(name: str) -> bool:
    return name.endswith(PACKED)


def pack_experts(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' expert weight [E, in, out] -> ``name_blocks`` [E, out, in / 32, 16] and ``name_scales``
    [E, out, in / 32], one expert at a time (a whole layer's codes would take 8 bytes a weight)."""
    if weight.shape[1] % 32:
        raise MegapipeError(
            f"MXFP4 packs 32 inputs per scale, but {name} has {weight.shape[1]} inputs: export it without MXFP4"
        )
    packed = [encode_mxfp4(expert.transpose(0, 1)) for expert in weight]
    return {name + BLOCKS: torch.stack([b for b, _ in packed]), name + SCALES: torch.stack([s for _, s in packed])}


class Mxfp4Reader:
    """A SafetensorsReader where each ``X_blocks`` / ``X_scales`` pair reads as one tensor ``X``, dequantized and laid
    out as transformers holds it ([E, in, out])."""

    def __init__(self, reader):
        self.reader = reader
        self.packed = {n[: -len(BLOCKS)] for n in reader.names() if n.endswith(BLOCKS)}

    def names(self) -> set[str]:
        other = {n for n in self.reader.names() if not n.endswith((BLOCKS, SCALES))}
        return other | self.packed

    def get(self, name: str) -> torch.Tensor:
        if name not in self.packed:
            return self.reader.get(name)
        return decode_mxfp4(self.reader.get(name + BLOCKS), self.reader.get(name + SCALES)).transpose(1, 2)

    def dtype(self):
        return self.reader.dtype()
