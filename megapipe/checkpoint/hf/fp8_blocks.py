"""FP8 block-scaled Hugging Face checkpoints as DeepSeek publishes them: each quantized linear weight is float8 (e4m3)
with ``<name>_scale_inv`` beside it (DeepSeek-V4: ``<module>.scale`` beside ``<module>.weight``), one scale per
``weight_block_size`` block (128 x 128; fp32, or a power of two as an e8m0 exponent), and config.json's
``quantization_config`` says so (``quant_method: fp8``, ``fmt: e4m3``). DeepSeek-V4's experts are FP4 instead: int8
bytes of two e2m1 values with one e8m0 scale per 32 values of a row, MXFP4's layout (megapipe.checkpoint.hf.mxfp4).
Import reads them dequantized: weight times its block's scale, in fp32."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megapipe.checkpoint.hf.mxfp4 import decode_mxfp4
from megapipe.errors import MegapipeError

SCALE_SUFFIX = "_scale_inv"
V4_SCALE_SUFFIX = ".scale"  # DeepSeek-V4's: <module>.scale beside <module>.weight


def block_fp8_config(config: dict[str, Any], where: str) -> Optional[tuple[int, int]]:
    """The (rows, columns) block of a block-scaled FP8 checkpoint's ``quantization_config``; None for others."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or not quant.get("weight_block_size"):
        return None
    fmt = quant.get("fmt", "e4m3")
    block = quant["weight_block_size"]
    if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                                  for b in block)):
        raise MegapipeError(f"{where}: quantization_config fmt = {fmt!r}, weight_block_size = {block!r} is not "
                            "supported (FP8 e4m3 with [rows, columns] blocks is)")
    return block[0], block[1]


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as fp32: e8m0 exponents (uint8 or float8_e8m0fnu) are 2^(e - 127)."""
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)):
        return torch.exp2(scale.view(torch.uint8).float() - 127)
    return scale.float()


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [out, in] (fp8) x scale_inv [ceil(out / rows), ceil(in / columns)] per block -> fp32 [out, in]; an int8
    weight [out, in / 2] is FP4 (two e2m1 values a byte, the low nibble first) with one scale per 32 values."""
    if weight.dtype == torch.int8:
        groups = scale_inv.shape[-1]
        unit = torch.full(scale_inv.shape, 127, dtype=torch.uint8)  # 2^0: the scales are applied below
        values = decode_mxfp4(weight.view(torch.uint8).unflatten(-1, (groups, -1)), unit)
        return (values.unflatten(-1, (groups, -1)) * scale_values(scale_inv)[..., None]).flatten(-2)
    rows, cols = weight.shape
    scale = scale_values(scale_inv).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


class DequantizingReader:
    """A SafetensorsReader whose quantized weights read dequantized; the scales are not tensors of their own."""

    def __init__(self, reader, block: tuple[int, int]):
        self.reader, self.block = reader, block
        names = reader.names()
        self.scale_of = {n[: -len(SCALE_SUFFIX)]: n for n in names if n.endswith(SCALE_SUFFIX)}
        self.scale_of.update({n[: -len(V4_SCALE_SUFFIX)] + ".weight": n for n in names
                              if n.endswith(V4_SCALE_SUFFIX) and n[: -len(V4_SCALE_SUFFIX)] + ".weight" in names})
        self.fp4 = False  # whether any weight read so far was FP4

    def names(self) -> set[str]:
        return set(self.reader.names()) - set(self.scale_of.values())

    def get(self, name: str) -> torch.Tensor:
        tensor = self.reader.get(name)
        if name not in self.scale_of:
            return tensor
        self.fp4 |= tensor.dtype == torch.int8
        return dequantize(tensor, self.reader.get(self.scale_of[name]), self.block)

    def dtype(self):
        return self.reader.dtype()
