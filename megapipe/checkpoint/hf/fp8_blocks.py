"""FP8 block-scaled Hugging Face checkpoints as DeepSeek publishes them: each quantized linear weight is float8 (e4m3)
with ``<name>_scale_inv`` beside it, one fp32 scale per ``weight_block_size`` block (128 x 128), and config.json's
``quantization_config`` says so (``quant_method: fp8``, ``fmt: e4m3``). Import reads them dequantized: weight times
its block's scale, in fp32."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megapipe.errors import MegapipeError

SCALE_SUFFIX = "_scale_inv"


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


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [out, in] (fp8) x scale_inv [ceil(out / rows), ceil(in / columns)] per block -> fp32 [out, in]."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


class DequantizingReader:
    """A SafetensorsReader whose quantized weights read dequantized; the scales are not tensors of their own."""

    def __init__(self, reader, block: tuple[int, int]):
        self.reader, self.block = reader, block
        self.scaled = {n[: -len(SCALE_SUFFIX)] for n in reader.names() if n.endswith(SCALE_SUFFIX)}

    def names(self) -> set[str]:
        return {n for n in self.reader.names() if not n.endswith(SCALE_SUFFIX)}

    def get(self, name: str) -> torch.Tensor:
        tensor = self.reader.get(name)
        if name not in self.scaled:
            return tensor
        return dequantize(tensor, self.reader.get(name + SCALE_SUFFIX), self.block)

    def dtype(self):
        return self.reader.dtype()
