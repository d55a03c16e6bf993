"""Decoder-only transformer models (no parallel code here: parallelism is applied from megapipe.parallel)."""

from megapipe.models import vision  # noqa: F401  (registers the vision-language model with build_model)
from megapipe.models.transformer import Transformer, build_model, count_params, flops_per_token

__all__ = ["Transformer", "build_model", "count_params", "flops_per_token"]
