"""Images in the engine (a vision-language model, megapipe.models.vision): a request's images as its image
processor made them (patches and (frames, height, width) grids), the M-RoPE positions of its prompt, and the vision
tower's embeddings of its image tokens, computed by the first prefill step that needs them and kept with the request.
:class:`PromptImages` checks them against the model's config alone, so a server's front end makes it (a bad image a
400 there) and an engine core process takes it as it is.

The KV blocks of a prompt with images depend on the images as well as the tokens: the prompt's chain of block hashes
starts from a hash of the images (``hash_seed``), so the prefix cache shares blocks between requests with the same
images and text only.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from megapipe.errors import MegapipeError
from megapipe.inference.sampling import ParamError
from megapipe.models.rope import rope_cos_sin
from megapipe.models.vision import mrope_positions


class PromptImages:
    def __init__(self, cfg, prompt_ids: Sequence[int], pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
        if not cfg.vision_depth or cfg.image_token_id is None:
            raise ParamError("images", "this model takes text only (it has no vision tower and image token)")
        self.pixel_values, self.grid_thw = pixel_values, torch.as_tensor(image_grid_thw).view(-1, 3)
        ids = torch.tensor([list(prompt_ids)])
        try:
            positions, delta = mrope_positions(ids, self.grid_thw, cfg.image_token_id, cfg.vision_spatial_merge_size)
        except MegapipeError as e:  # the image and the tokens it lacks, as the request's mistake
            raise ParamError("images", str(e)) from None
        placed = int((ids == cfg.image_token_id).sum())
        wanted = int(self.grid_thw.prod(-1).sum()) // cfg.vision_spatial_merge_size ** 2
        if placed != wanted:
            raise ParamError("images", f"the prompt holds {placed} image tokens but its images make {wanted}")
        self.positions, self.delta = positions[:, 0], int(delta[0])  # [3, prompt length], the text offset after
        self.slot = torch.cumsum(ids[0] == cfg.image_token_id, 0) - 1  # each image token's embedding row
        self.is_image = ids[0] == cfg.image_token_id
        digest = hashlib.sha256(self.grid_thw.to(torch.int64).numpy().tobytes())
        digest.update(pixel_values.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
        self.hash_seed = digest.digest()
        self.embeddings: Optional[torch.Tensor] = None

    def rope_positions(self, start: int, n: int) -> torch.Tensor:
        """M-RoPE positions [3, n] of tokens start .. start + n (past the prompt: the index plus the text offset)."""
        idx = torch.arange(start, start + n)
        inside = idx < self.positions.shape[1]
        out = (idx + self.delta).expand(3, -1).clone()
        out[:, inside] = self.positions[:, idx[inside]]
        return out

    def embed(self, model, h: torch.Tensor, start: int) -> None:
        """Write the image embeddings into ``h`` [n, H], the input rows of tokens start .. start + n."""
        n = min(h.shape[0], self.is_image.shape[0] - start)
        rows = self.is_image[start:start + n].nonzero()[:, 0] if n > 0 else None
        if rows is None or not len(rows):
            return
        if self.embeddings is None:  # the prefill step that first reaches an image runs the vision tower
            pixels = self.pixel_values.to(h.device, next(model.visual.parameters()).dtype)
            self.embeddings = model.visual(pixels, self.grid_thw)
        h[rows] = self.embeddings[self.slot[start + rows]].to(h.dtype)


def multimodal_step(model, inv_freq: torch.Tensor, scale: float, images: Sequence[Optional[PromptImages]],
                    starts: Sequence[int], lengths: Sequence[int], positions: torch.Tensor, h: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The image rows of a flattened batch's input ``h`` [T, H] (rows: ``lengths`` tokens of each batch entry from
    ``starts``, ``images`` for each: None for a text request) and its rotary cos, sin [T, head_dim]: M-RoPE, which
    for text is the 1-D rope of ``positions`` [1, T]."""
    rope = positions.expand(3, -1, -1).clone()  # [3, 1, T]
    offset = 0
    for img, start, n in zip(images, starts, lengths, strict=True):
        if img is not None:
            img.embed(model, h[offset:offset + n], start)
            rope[:, 0, offset:offset + n] = img.rope_positions(start, n).to(rope.device)
        offset += n
    cos, sin = rope_cos_sin(rope, inv_freq, h.dtype, scale, model.cfg.mrope_section)
    return cos[0, 0], sin[0, 0]
