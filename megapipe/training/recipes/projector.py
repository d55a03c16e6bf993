"""Pretraining a vision-language model's projector on image-caption pairs (LLaVA's stage 1, feature alignment):
the vision tower and the decoder frozen, only the projector (Qwen2.5-VL's patch merger) trained, on the captions'
tokens. The pairs are SFT records whose user turn holds the image and whose assistant turn is its caption (the
bundled pipelines/data/captions.jsonl, written by tools/make_caption_fixture.py), rendered by the chat template and
indexed as SFT's; so the recipe is SFT's with one part of the model trained and a stage name of its own."""

from __future__ import annotations

from megapipe.errors import ConfigError
from megapipe.models.capabilities import requested_layouts, require
from megapipe.training.recipes.sft import SFTRecipe


class ProjectorRecipe(SFTRecipe):
    stage = "projector"

    def check(self, run) -> None:
        model = run.cfg.model
        if not getattr(model, "vision_depth", 0):
            raise ConfigError("posttrain projector trains a vision-language model's projector; this model has no "
                              "vision tower (model.vision_depth = 0)")
        for key, on in (("sft.freeze_projector", run.cfg.sft.freeze_projector), ("lora.rank", run.cfg.lora.rank)):
            if on:
                raise ConfigError(f"posttrain projector trains the projector alone: {key} = {on} does not apply")
        # what SFT may do with this architecture, this recipe may too (its own stage is not a row of the table)
        require(model, "sft", "posttrain projector", layouts=requested_layouts(run.cfg.parallel),
                packing=self.packed_sequences(run.cfg))
        super().check(run)

    def prepare_model(self, ctx, model):
        model.requires_grad_(False)
        model.visual.merger.requires_grad_(True)
        return model
