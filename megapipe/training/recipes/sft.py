"""Supervised fine-tuning: chat / prompt-completion / text records (megapipe.data.sft), tokenized once into a cached
index (megapipe.data.sft_dataset), next-token cross-entropy on the trained tokens only (the assistant's, unless
--train-on-prompt), optional packing (block-diagonal attention, positions restarting per conversation) and LoRA.

The chat template the data was rendered with is written into every checkpoint's tokenizer (``chat_template.jinja``
and ``tokenizer_config.json``), so generation and serving format conversations the same way.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional

from megapipe.data.chat_template import OWN
from megapipe.data.gpt_dataset import parse_split
from megapipe.data.images import ImageProcessor, image_markers
from megapipe.data.sft import ChatEncoder
from megapipe.data.sft_dataset import SFTImages, SFTLoader, build_sft_datasets, prepare_sft_index, progress_printer
from megapipe.data.tokenizer import load_tokenizer
from megapipe.errors import ConfigError
from megapipe.models.lora import apply_lora
from megapipe.posttrain.lora import check_lora_run, load_base_weights, lora_spec
from megapipe.posttrain.start import START_KEY, start_of
from megapipe.training.recipes.base import Recipe, RunContext


class LoRARecipe(Recipe):
    """A recipe that trains LoRA adapters when ``--lora-rank`` asks (SFT, DPO): the adapters added to the built
    model, the checkpoint's weights loaded into its base."""

    def prepare_model(self, ctx: RunContext, model):
        spec = lora_spec(ctx.cfg)
        return apply_lora(model, spec, seed=ctx.cfg.train.seed) if spec is not None else model

    def load_weights(self, ctx: RunContext, model, ckpt) -> None:
        if lora_spec(ctx.cfg) is None:
            return super().load_weights(ctx, model, ckpt)
        load_base_weights(ckpt, model)


class SFTRecipe(LoRARecipe):
    stage = "sft"

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._index = None
        self._encoder = None
        self._datasets: Optional[dict] = None
        self._tokenizer_dir: Optional[tempfile.TemporaryDirectory] = None

    # ------------------------------------------------------------------------------------------- checks

    def prepare_model(self, ctx: RunContext, model):
        model = super().prepare_model(ctx, model)
        freeze = {"--freeze-vision": ctx.cfg.sft.freeze_vision, "--freeze-projector": ctx.cfg.sft.freeze_projector}
        visual = getattr(model, "visual", None)
        for flag, on in freeze.items():
            if on and visual is None:
                raise ConfigError(f"{flag} needs a vision-language model; this model has no vision tower")
        if ctx.cfg.sft.freeze_vision:
            for p in [*visual.patch_embed.parameters(), *visual.blocks.parameters()]:
                p.requires_grad_(False)
        if ctx.cfg.sft.freeze_projector:
            visual.merger.requires_grad_(False)
        return model

    def packed_sequences(self, cfg) -> bool:
        return cfg.sft.packing

    def check(self, run) -> None:
        """Refuse what cannot run, and tokenize the data now (cached): a bad record stops the run before launch."""
        if run.tokenizer is None:
            raise ConfigError("posttrain sft needs a tokenizer: the --load checkpoint holds none, so give --tokenizer")
        check_lora_run(run.cfg, run.resume)
        self.index(run.cfg, run.tokenizer)

    def encoder(self, cfg, tokenizer):
        if self._encoder is None:
            self._encoder = ChatEncoder(tokenizer.path, cfg.sft.chat_template, cfg.sft.train_on_prompt,
                                        image_markers(getattr(cfg, "model", None), tokenizer))
        return self._encoder

    def index(self, cfg, tokenizer):
        if self._index is None:
            encoder = self.encoder(cfg, tokenizer)
            with progress_printer(enabled=True) as progress:
                images = (SFTImages(ImageProcessor.from_dir(tokenizer.path), cfg.model.image_token_id)
                          if encoder.image_text is not None else None)
                self._index = prepare_sft_index(cfg.sft.data, encoder, cfg.sft.skip_bad_records, cfg.data.cache_dir,
                                                progress, images)
        return self._index

    # ------------------------------------------------------------------------------------------- model and data

    def datasets(self, ctx: RunContext) -> dict:
        if self._datasets is None:
            cfg, t = ctx.cfg, ctx.cfg.train
            gbs = t.global_batch_size
            has_valid = parse_split(cfg.data.split)[1] > 0
            wanted = {"train": ctx.train_iters * gbs, "valid": t.eval_iters * gbs if has_valid else 0}
            index = self.index(cfg, ctx.tokenizer)
            self._datasets = build_sft_datasets(index, cfg.data.split, cfg.data.seq_length, wanted, t.seed,
                                                cfg.sft.packing, cfg.sft.overlong, ctx.tokenizer.pad_id)
            if ctx.is_main and not self.quiet:
                from rich.console import Console

                Console().print(self.describe(cfg.data.seq_length, index))
        return self._datasets

    def describe(self, seq_length: int, index) -> str:
        """One paragraph on the data: conversations, trained tokens, skipped records, rows and packing."""
        m, train, valid = index.meta, self._datasets["train"], self._datasets.get("valid")
        skipped = f", {m['bad_records']} bad record(s) skipped" if m["bad_records"] else ""
        lines = [
            f"sft data: {m['conversations']:,} conversations ({len(train.conv_ids):,} train"
            f"{f', {len(valid.conv_ids):,} valid' if valid else ''}), {m['trained_tokens']:,} of {m['tokens']:,} "
            f"tokens trained{skipped}; chat template {m['chat_template']}; "
            f"{'packed' if train.packing else 'one per row'}: {train.per_epoch:,} rows of "
            f"{seq_length} tokens, {100 * train.efficiency:.1f}% not padding"
            f"{f', {train.truncated} cut at --seq-length' if train.truncated else ''}"
            f"{f', {train.dropped} left out' if train.dropped else ''}"
            f"{' (index cached)' if index.cache_hit else ''}"
        ]
        lines += [f"  [yellow]skipped[/] {line}" for line in m.get("bad_examples", [])]
        return "\n".join(lines)

    def _loader(self, ctx: RunContext, dataset, consumed: int = 0):
        t = ctx.cfg.train
        return SFTLoader(dataset, t.micro_batch_size, t.global_batch_size, ctx.dims.dp_rank, ctx.dims.dp_size,
                         consumed)

    def train_data(self, ctx: RunContext, model, state: dict):
        return self._loader(ctx, self.datasets(ctx)["train"], state.get("consumed_samples", 0))

    def eval_data(self, ctx: RunContext, split: str):
        ds = self.datasets(ctx).get(split)
        return None if ds is None else self._loader(ctx, ds)

    # ------------------------------------------------------------------------------------------- outputs

    def manifest(self, ctx: RunContext) -> dict:
        cfg = ctx.cfg
        train = self.datasets(ctx)["train"]
        out = {START_KEY: start_of(ctx.resume, ctx.parent), "sft": {
            "data": list(cfg.sft.data), "chat_template": self._encoder.template_name,
            "train_on_prompt": cfg.sft.train_on_prompt, "packing": cfg.sft.packing,
            "packing_efficiency": train.efficiency, "index": str(self._index.path),
        }}
        spec = lora_spec(cfg)
        if spec is not None:
            out["lora"] = spec.to_manifest()
        return out

    def summary(self, ctx: RunContext) -> dict:
        return {"packing_efficiency": self.datasets(ctx)["train"].efficiency}

    def tokenizer_files(self, ctx: RunContext):
        """The run's tokenizer with the chat template it was trained with (when that is not the one the tokenizer
        renders with by itself: a named, built-in or file template)."""
        source = ctx.tokenizer.path
        enc = self._encoder
        if enc.chat is None or enc.chat.name == OWN:
            return source
        if self._tokenizer_dir is None:
            self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="megapipe-sft-tokenizer-")
            write_tokenizer_with_template(source, Path(self._tokenizer_dir.name), enc.template)
        return Path(self._tokenizer_dir.name)


def write_tokenizer_with_template(source, out: Path, template: str) -> Path:
    """Copy tokenizer ``source`` (directory or tokenizer.json) to ``out`` with ``template`` as its chat template
    (``chat_template.jinja``, read by transformers 5, and tokenizer_config.json's ``chat_template``, read by 4)."""
    load_tokenizer(source).save(out)
    for name in ("chat_template.json",):
        (out / name).unlink(missing_ok=True)
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out

