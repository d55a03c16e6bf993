"""Inference: the decoding engine (continuous batching, paged KV cache, prefix caching), sampling, the server."""

from megapipe.inference.engine import CompletionOutput, EngineConfig, LLMEngine, RequestOutput
from megapipe.inference.generate import generate, generate_ids
from megapipe.inference.sampling import ParamError, SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "ParamError", "RequestOutput", "SamplingParams",
           "generate", "generate_ids"]
