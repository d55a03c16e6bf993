"""Recipes: what one training stage adds to the one training loop (its data, its loss, its stage name)."""

from megapipe.training.recipes.base import Recipe, RunContext
from megapipe.training.recipes.pretrain import PretrainRecipe

__all__ = ["PretrainRecipe", "Recipe", "RunContext"]
