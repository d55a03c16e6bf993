"""Generation: KV cache, sampling, batched decoding."""

from megapipe.inference.generate import filter_logits, generate, generate_ids, pick_next, resolve_device
from megapipe.inference.kv_cache import KVCache

__all__ = ["KVCache", "filter_logits", "generate", "generate_ids", "pick_next", "resolve_device"]
