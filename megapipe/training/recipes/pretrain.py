"""Pretraining: Megatron GPT samples (a blend of .bin/.idx prefixes, train/valid/test split) and next-token
cross-entropy. With Megatron's ``--reset-position-ids`` / ``--reset-attention-mask`` / ``--eod-mask-loss`` a
sample holding several documents is treated as packed: positions restart and attention stays within a document
after each end-of-document token, and the prediction made at that token is not trained on."""

from __future__ import annotations

from typing import Optional

import torch

from megapipe.config import parse_data_path
from megapipe.data.gpt_dataset import build_gpt_datasets, parse_split
from megapipe.data.loader import PretrainingLoader
from megapipe.data.sidecar import check_data_tokenizer
from megapipe.errors import ConfigError
from megapipe.models.attention import positions_from_documents
from megapipe.training.recipes.base import Recipe, RunContext


def split_at_eod(batch: dict, eod_id: int, reset_positions: bool, reset_attention: bool, mask_loss: bool) -> dict:
    """Add ``document_ids`` / ``position_ids`` / ``loss_mask`` to a batch of concatenated documents. An end-of-
    document token belongs to the document it ends; the next token starts a new one (Megatron's convention)."""
    tokens = batch["tokens"]
    is_eod = tokens == eod_id
    out = dict(batch)
    doc = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()  # exclusive count: the EOD stays in its document
    if reset_attention:
        out["document_ids"] = doc
    if reset_positions:
        out["position_ids"] = positions_from_documents(doc)
    if mask_loss:
        out["loss_mask"] = ~is_eod
    return out


class PretrainRecipe(Recipe):
    stage = "pretrain"
    new_mtp = True

    def __init__(self):
        self._datasets: Optional[dict] = None

    def packed_sequences(self, cfg) -> bool:
        return cfg.data.reset_attention_mask or cfg.data.reset_position_ids

    def check(self, run) -> None:
        d = run.cfg.data
        if not d.data_path:
            raise ConfigError("data.data_path (--data-path) is not set: give the PREFIX of a .bin/.idx pair")
        if run.tokenizer is not None and not d.allow_tokenizer_mismatch:
            check_data_tokenizer(parse_data_path(d.data_path)[0], run.tokenizer)
        if (d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss) and (
            run.tokenizer is None or run.tokenizer.eod_id is None
        ):
            raise ConfigError(
                "data.reset_attention_mask / reset_position_ids / eod_mask_loss need the end-of-document token: "
                "give --tokenizer (one with an end-of-document token)"
            )

    def datasets(self, ctx: RunContext) -> dict:
        if self._datasets is None:
            d, t = ctx.cfg.data, ctx.cfg.train
            gbs = t.global_batch_size
            has_valid = parse_split(d.split)[1] > 0
            num_samples = {"train": ctx.train_iters * gbs, "valid": t.eval_iters * gbs if has_valid else 0}
            self._datasets = build_gpt_datasets(d.data_path, d.split, d.seq_length, num_samples, t.seed, d.cache_dir)
        return self._datasets

    def _loader(self, ctx: RunContext, dataset, consumed: int = 0):
        t, d = ctx.cfg.train, ctx.cfg.data
        loader = PretrainingLoader(dataset, t.micro_batch_size, t.global_batch_size, ctx.dims.dp_rank,
                                   ctx.dims.dp_size, consumed)
        if d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss:
            eod = ctx.tokenizer.eod_id
            loader.transform = lambda b: split_at_eod(b, eod, d.reset_position_ids, d.reset_attention_mask,
                                                      d.eod_mask_loss)
        return loader

    def train_data(self, ctx: RunContext, model, state: dict):
        return self._loader(ctx, self.datasets(ctx)["train"], state.get("consumed_samples", 0))

    def eval_data(self, ctx: RunContext, split: str):
        ds = self.datasets(ctx).get(split)
        return None if ds is None else self._loader(ctx, ds)
