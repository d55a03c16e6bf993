"""Vision-language models: Qwen2.5-VL's vision tower (a ViT with 2-D rotary, window and full attention) and its
spatial patch merger in front of any megapipe decoder.

Images arrive as the patches an image processor cut them into (``pixel_values`` [N, C * T * P * P], T frames a
temporal patch, P pixels a side) and a (frames, height, width) patch grid per image, the patches of each image in
merge-block order (the ``vision_spatial_merge_size`` x ``vision_spatial_merge_size`` neighbours that the merger joins
into one token are consecutive). The tower embeds the patches (a Conv3d over temporal patches), runs its blocks
(attention within a window of merged patches, or a whole frame in the full-attention blocks) and merges each block of
patches into one decoder-wide embedding; those fill the decoder's image placeholder tokens. Windows are masks over
the patches in their given order: attention does not depend on the order of its keys, so the patches need no
reordering into windows.

The decoder rotates its queries and keys with M-RoPE: an image token's (temporal, height, width) position is its
place in the grid of merged patches, offset by the text before it; text tokens have one position on all three axes,
so a text-only input is the plain 1-D rope (``mrope_positions``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.models.dense import FeedForward
from megapipe.models.mamba import scale_by
from megapipe.models.norms import RMSNorm
from megapipe.models.rope import apply_rope, inv_frequencies, rope_cos_sin
from megapipe.models.transformer import MODEL_CLASSES, Transformer

VISION_NORM_EPS = 1e-6  # Qwen2.5-VL's vision norms (not in its config)


def vision_mlp_config(cfg: ModelConfig) -> ModelConfig:
    """The vision blocks' MLP as a decoder MLP's config: SwiGLU with biases, the tower's widths."""
    return dataclasses.replace(cfg, hidden_size=cfg.vision_hidden_size, intermediate_size=cfg.vision_intermediate_size,
                               activation="swiglu", mlp_bias=True)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t, p = cfg.vision_temporal_patch_size, cfg.vision_patch_size
        self.shape = (cfg.vision_in_channels, t, p, p)
        self.proj = nn.Conv3d(cfg.vision_in_channels, cfg.vision_hidden_size, (t, p, p), stride=(t, p, p), bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.reshape(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).flatten(1)


class VisionAttention(nn.Module):
    """Bidirectional attention over the patches a mask lets each patch see, rotary applied in float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.vision_hidden_size
        self.head_dim = d // cfg.vision_num_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, rope: tuple, mask: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, -1, self.head_dim).permute(1, 2, 0, 3)[:, None]  # each [1, heads, N, hd]
        q, k = (apply_rope(t.float(), *rope).to(x.dtype) for t in (q, k))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out[0].transpose(0, 1).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.vision_hidden_size, VISION_NORM_EPS)
        self.attn = VisionAttention(cfg)
        self.norm2 = RMSNorm(cfg.vision_hidden_size, VISION_NORM_EPS)
        self.mlp = FeedForward(vision_mlp_config(cfg))

    def forward(self, x: torch.Tensor, rope: tuple, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each block of merge x merge patches -> one token of the decoder's width: norm, concatenate, a GELU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        width = cfg.vision_hidden_size * cfg.vision_spatial_merge_size ** 2
        self.norm = RMSNorm(cfg.vision_hidden_size, VISION_NORM_EPS)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, cfg.hidden_size)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x).view(-1, self.width))))


def patch_layout(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the patches of images with (frames, height, width) patch grids ``grid_thw`` [I, 3], in merge-block order:
    (height / width positions [2, N], the frame each belongs to [N], its attention window [N]); ``window``: merged
    patches a window's side (windows start at each frame's top left corner; the last ones of a row or column are cut
    short by the frame's edge)."""
    positions, frames, windows = [], [], []
    frame0 = window0 = 0
    for t, h, w in grid_thw.tolist():
        bh, bw = h // merge, w // merge
        grid = torch.arange(h * w).view(bh, merge, bw, merge).permute(0, 2, 1, 3).reshape(-1)  # merge-block order
        hpos, wpos = grid // w, grid % w
        across = math.ceil(bw / window)
        per_frame = math.ceil(bh / window) * across
        win = (hpos // merge // window) * across + (wpos // merge // window)
        positions.append(torch.stack([hpos, wpos]).repeat(1, t))
        frames.append(torch.arange(frame0, frame0 + t).repeat_interleave(h * w))
        windows.append((torch.arange(t)[:, None] * per_frame + win + window0).reshape(-1))
        frame0, window0 = frame0 + t, window0 + t * per_frame
    return torch.cat(positions, 1), torch.cat(frames), torch.cat(windows)


class VisionEncoder(nn.Module):
    """Qwen2.5-VL's vision tower and patch merger: patches [N, C * T * P * P] -> image embeddings [N / merge^2,
    the decoder's hidden size].

    ``every_batch`` (set by data parallelism, megapipe.parallel.dp): the tower runs on every forward, on a blank
    stand-in image that adds nothing where a batch holds none, so that every rank gathers and reduces its parameters
    in the same collectives."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.every_batch = False
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.vision_depth)])
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        merge = cfg.vision_spatial_merge_size
        window = cfg.vision_window_size // merge // cfg.vision_patch_size
        positions, frames, windows = patch_layout(grid_thw.cpu(), merge, window)
        device = pixel_values.device
        if positions.shape[1] != pixel_values.shape[0]:
            raise MegapipeError(f"the image grids {grid_thw.tolist()} hold {positions.shape[1]} patches but "
                                f"pixel_values has {pixel_values.shape[0]}")
        head_dim = cfg.vision_hidden_size // cfg.vision_num_heads
        inv_freq = inv_frequencies(head_dim // 2, cfg.vision_rope_theta, None, device)
        # height then width, each turning the same head_dim / 4 frequencies
        rope = rope_cos_sin(positions.to(device)[:, None], inv_freq.repeat(2), torch.float32,
                            sections=[head_dim // 4] * 2)
        full, local = ((ids[:, None] == ids[None]).to(device) for ids in (frames, windows))
        x = self.patch_embed(pixel_values)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full if i in cfg.vision_fullatt_block_indexes else local)
        return self.merger(x)


def mrope_positions(tokens: torch.Tensor, grid_thw: Optional[torch.Tensor], image_token_id: int,
                    merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions [3, B, S] of ``tokens`` [B, S] whose runs of ``image_token_id`` hold the images of
    ``grid_thw`` (in order, over the rows), and each row's offset of the text after it (the next position minus the
    row's length, what decoding adds to a token's index). A text token is one past the largest position before it on
    every axis; an image's tokens are (frame, row, column) of its merged grid plus the position it starts at."""
    b, s = tokens.shape
    grids = iter(grid_thw.tolist() if grid_thw is not None else [])
    out = torch.empty(3, b, s, dtype=torch.long)
    deltas = torch.empty(b, dtype=torch.long)
    for row, ids in enumerate((tokens == image_token_id).tolist()):
        parts, start, i = [], 0, 0
        while i < s:
            if not ids[i]:
                j = i
                while j < s and not ids[j]:
                    j += 1
                parts.append(torch.arange(start, start + j - i).expand(3, -1))
                start += j - i
            else:
                grid = next(grids, None)
                if grid is None:
                    raise MegapipeError(f"the tokens hold more images (runs of image token {image_token_id}) than "
                                        "image_grid_thw gives grids")
                t, h, w = grid[0], grid[1] // merge, grid[2] // merge
                j = i + t * h * w
                if j > s or not all(ids[i:j]):
                    raise MegapipeError(f"an image of grid {grid} needs {t * h * w} image tokens at position {i}, "
                                        f"but the tokens hold {sum(ids[i:min(j, s)])} in a row there")
                axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                parts.append(torch.stack(axes).reshape(3, -1) + start)
                start += max(h, w)
            i = j
        out[:, row] = torch.cat(parts, 1)
        deltas[row] = out[:, row].max() + 1 - s
    return out.to(tokens.device), deltas


def rowwise_images(tokens: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                   image_token_id: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's images (``pixel_values`` [N, D] and ``image_grid_thw`` [I, 3] over the rows of ``tokens`` [B, S], in
    row order) row by row, zero-padded: pixels [B, P, D] and grids [B, I', 3] (padding grids are zeros), so that
    cutting every tensor along its first dimension (a pipeline schedule's micro-batches) keeps each row's images."""
    grids, rows, g = image_grid_thw.tolist(), [], 0
    for row, n in enumerate((tokens == image_token_id).sum(1).tolist()):
        start = g
        while n > 0 and g < len(grids):
            n -= math.prod(grids[g]) // merge ** 2
            g += 1
        if n:
            raise MegapipeError(f"row {row} of the batch holds image tokens (id {image_token_id}) that the image "
                                f"grids {grids[start:g]} do not fill")
        rows.append((start, g))
    if g != len(grids):
        raise MegapipeError(f"the batch's image tokens fill {g} of its {len(grids)} image grids")
    ends = torch.cumsum(image_grid_thw.prod(-1), 0).tolist()
    patch = [(ends[a - 1] if a else 0, ends[b - 1] if b else 0) for a, b in rows]
    pixels = pixel_values.new_zeros(len(rows), max([b - a for a, b in patch], default=0), pixel_values.shape[-1])
    out = image_grid_thw.new_zeros(len(rows), max([b - a for a, b in rows], default=0), 3)
    for r, ((a, b), (p, q)) in enumerate(zip(rows, patch, strict=True)):
        out[r, : b - a] = image_grid_thw[a:b]
        pixels[r, : q - p] = pixel_values[p:q]
    return pixels, out


def flat_images(pixels: torch.Tensor, grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rowwise_images``' padded pixels [B, P, D] and grids [B, I, 3] -> pixel_values [N, D], image_grid_thw [I, 3]."""
    sizes = grids.prod(-1)
    patches = torch.arange(pixels.shape[1], device=pixels.device)[None] < sizes.sum(1, keepdim=True)
    return pixels[patches], grids[sizes > 0]


class VisionLanguageModel(Transformer):
    """A megapipe decoder with a vision tower (``visual``): a text-only forward is the decoder's; with
    ``pixel_values`` and ``image_grid_thw`` the image tokens' embeddings are the tower's output and the positions,
    when not given, M-RoPE's.

    Pipeline stages (megapipe.parallel.pp) keep the tower on the first stage (``visual`` is None on the others) and
    take batch-first inputs, as the schedule cuts them into micro-batches: ``mrope_position_ids`` [B, 3, S] (what
    every stage rotates by) and the images row by row (``rowwise_images``: pixels [B, P, D], grids [B, I, 3])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.visual = VisionEncoder(cfg)

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None, cache=None, *args,
                pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                mrope_position_ids: Optional[torch.Tensor] = None, **kwargs):
        if mrope_position_ids is not None:
            positions = mrope_position_ids.movedim(1, 0)
        if pixel_values is not None and image_grid_thw is None:
            raise ValueError("pixel_values come with image_grid_thw: each image's (frames, height, width) patches")
        if pixel_values is not None and pixel_values.dim() == 3:
            pixel_values, image_grid_thw = flat_images(pixel_values, image_grid_thw)
        if pixel_values is not None and not len(image_grid_thw):
            pixel_values = None
        if self.visual is None or tokens.is_floating_point() or (pixel_values is None and not self.visual.every_batch):
            return super().forward(tokens, positions, cache, *args, **kwargs)
        if pixel_values is not None and self.cfg.image_token_id is None:
            raise MegapipeError("model.image_token_id is not set: images need the tokenizer's image placeholder token")
        h = self.embed_images(tokens, pixel_values, image_grid_thw)
        if positions is None and pixel_values is not None:
            positions = mrope_positions(tokens, image_grid_thw, self.cfg.image_token_id,
                                        self.cfg.vision_spatial_merge_size)[0]
        return super().forward(h, positions, cache, *args, **kwargs)

    def embed_images(self, tokens: torch.Tensor, pixel_values: torch.Tensor,
                     image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The decoder's input embeddings [B, S, H] of ``tokens``, the image placeholders' from the vision tower
        (no ``pixel_values``: the tower's output on a blank image, times zero)."""
        h = scale_by(self.tok_embeddings(tokens), self.cfg.embedding_multiplier)
        if pixel_values is None:
            m, shape = self.cfg.vision_spatial_merge_size, self.visual.patch_embed.shape
            grid = torch.tensor([[1, m, m]], device=tokens.device)
            blank = self.visual(torch.zeros(m * m, math.prod(shape), device=tokens.device), grid)
            return h + 0.0 * blank.sum().to(h.dtype)
        images = self.visual(pixel_values, image_grid_thw)
        slots = tokens == self.cfg.image_token_id
        if int(slots.sum()) != images.shape[0]:
            raise MegapipeError(f"the tokens hold {int(slots.sum())} image tokens (id {self.cfg.image_token_id}) but "
                                f"the images make {images.shape[0]} embeddings")
        return h.masked_scatter(slots[..., None], images.to(h.dtype))

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        nn.init.normal_(self.visual.patch_embed.proj.weight, 0.0, self.cfg.init_std)


MODEL_CLASSES["vision"] = VisionLanguageModel
