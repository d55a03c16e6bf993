"""How much GPU memory the KV cache gets by default: vLLM's ``--gpu-memory-utilization``.

The engine's process may use ``utilization`` of the GPU's memory in all. What is in use already when the pool is
sized (the weights, the CUDA context, other processes on the same GPU) and what one step's activations will need
(``step_reserve``) come off it; the KV cache gets the rest, never more than ``max_num_seqs`` sequences of
``max_model_len`` tokens need (more would only keep more prompt blocks for the prefix cache). On a CPU the default
stays what the batch needs, at most 1 GiB (``EngineConfig.kv_cache_memory``'s comment).
"""

from __future__ import annotations

import torch

from megapipe.errors import ConfigError

GiB = 1 << 30
# cuBLAS workspaces, the caching allocator's rounding and the sampler's temporaries beyond step_reserve's estimate
CUDA_SLACK = 512 << 20


def step_reserve(hidden: int, widest: int, vocab: int, tokens: int, sampled_rows: int, element_size: int) -> int:
    """Bytes one step's activations take at most: per token of the step's budget the residual stream, its norm,
    the attention's and MLP's inputs and outputs (a few hidden-wide rows) and the widest projection's output in the
    model's dtype, twice over for the allocator's temporaries; the fp32 logits of the sampled rows, four copies
    (logits, probabilities, the sampler's sorted or masked ones); and CUDA_SLACK."""
    per_token = (6 * hidden + 2 * widest) * element_size
    return 2 * tokens * per_token + 4 * sampled_rows * vocab * 4 + CUDA_SLACK


def kv_memory_on_gpu(device: torch.device, utilization: float, reserve: int, wanted: int, minimum: int) -> int:
    """Bytes for the KV cache on CUDA ``device``: ``utilization`` of its memory less what is in use now (every
    process's) and ``reserve``, at most ``wanted``; a ConfigError when that is under ``minimum`` (one sequence of
    --max-model-len)."""
    free, total = torch.cuda.mem_get_info(device)
    return kv_memory_of(total, total - free, utilization, reserve, wanted, minimum)


def kv_memory_of(total: int, used: int, utilization: float, reserve: int, wanted: int, minimum: int) -> int:
    """``kv_memory_on_gpu`` on given figures (bytes): the GPU's ``total``, ``used`` by now."""
    allowed = int(utilization * total) - used - reserve
    if allowed < minimum:
        raise ConfigError(
            f"--gpu-memory-utilization {utilization} allows {utilization * total / GiB:.2f} GiB of the GPU's "
            f"{total / GiB:.2f} GiB, of which {used / GiB:.2f} GiB are in use (weights, CUDA context, other "
            f"processes) and {reserve / GiB:.2f} GiB go to a step's activations, leaving "
            f"{max(allowed, 0) / GiB:.2f} GiB for the KV cache where one sequence of --max-model-len needs "
            f"{minimum / GiB:.3f} GiB: raise it, or give a smaller --max-model-len or --kv-cache-memory")
    return min(allowed, wanted)
