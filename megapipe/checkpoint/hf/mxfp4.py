"""MXFP4 expert weights as OpenAI publishes GPT-OSS: each ``<name>_blocks`` [E, rows, G, 16] (uint8) packs two 4-bit
e2m1 values per byte (the low nibble first) for G groups of 32 values per row, ``<name>_scales`` [E, rows, G]
(uint8) one shared e8m0 scale per group (2^(s - 127)); config.json's ``quantization_config`` says ``quant_method:
mxfp4``. The rows are the output features, so a tensor reads back as [E, rows, G * 32] and is handed on transposed,
[E, in, out], as transformers holds ``gate_up_proj`` / ``down_proj``. Import reads them dequantized, in fp32."""

from __future__ import annotations

from typing import Any

import torch

BLOCKS, SCALES = "_blocks", "_scales"
# e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 the same negated
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


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
