"""The decoding engine: continuous batching over a paged KV cache with prefix caching, per-request sampling.

One engine serves ``megapipe generate``, ``megapipe serve``, RL rollouts and evaluation. Use it synchronously::

    engine = LLMEngine.from_pretrained("runs/x/latest", dtype="bfloat16")
    outputs = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

or step by step (``add_request`` / ``step`` / ``abort``), which is what :class:`AsyncEngine` does in its thread.
Each step passes one typed contract to the next: the scheduler's plan (``SchedulerOutput``,
megapipe.inference.scheduler), the runner's result of running the model once on every scheduled token and sampling
(``RunnerOutput``, megapipe.inference.runner, megapipe.inference.sampling), applied by ``update_from_output``: stop
conditions, detokenizing (megapipe.inference.detokenize), blocks freed, one RequestOutput per request that progressed.
A hybrid Transformer-Mamba model keeps KV blocks for its attention layers only and a recurrent-state slot per
running sequence for its Mamba layers (megapipe.inference.state_cache); prefix caching is off for it.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

import megapipe.inference.kernels as kernels
from megapipe.checkpoint.load import eos_ids_of, load_model
from megapipe.dtypes import resolve_device, resolve_dtype
from megapipe.errors import ConfigError, MegapipeError
from megapipe.inference import compressed_cache, device_memory
from megapipe.inference.block_manager import BlockManager
from megapipe.inference.detokenize import Detokenizer, special_ids
from megapipe.inference.images import PromptImages
from megapipe.inference.kv_cache import KVPool, eviction_window, kv_layout, layer_windows, split_window
from megapipe.inference.lora import AdapterSlots
from megapipe.inference.runner import ModelRunner, RunnerOutput, say_once, widest_linear
from megapipe.inference.sampling import ParamError, SamplingParams
from megapipe.inference.scheduler import FINISHED, Scheduler, SchedulerOutput, now
from megapipe.inference.scheduler import Sequence as Seq
from megapipe.inference.speculative import MTPSpeculator, NgramSpeculator
from megapipe.inference.state_cache import StatePool, state_bytes_per_sequence
from megapipe.inference.threads import ThreadGovernor
from megapipe.models.attention import Attention
from megapipe.models.capabilities import capabilities, describe
from megapipe.models.compressed_attention import CompressedAttention
from megapipe.models.mla import MLAttention
from megapipe.models.transformer import attention_layers, kv_cache_values_per_token

GiB = 1 << 30
STATE_MEMORY = GiB  # default memory for hybrid models' recurrent states (besides the KV cache's default GiB)
SPECULATIVE_METHODS = ("mtp", "ngram")


class EngineStalled(RuntimeError):
    """A step scheduled nothing while sequences wait (a scheduler bug): raised instead of spinning forever."""


CPU_TOKEN_BUDGET = 1024  # EngineConfig.token_budget's default on a CPU
CPU_BLOCK_SIZE = 128  # EngineConfig.kv_block_size's default on a CPU (vLLM's CPU backend's too)
# vllm:iteration_tokens_total's buckets (vLLM's): the tokens a step computes (its token budget's share used)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _kv_modules(model) -> list:
    """The model's modules that keep keys and values in the pool."""
    return [m for m in model.layers.modules() if isinstance(m, (Attention, MLAttention, CompressedAttention))]


def plain_attention(model) -> bool:
    """Every layer of ``model`` that keeps keys is softmax attention over the pool and none keeps a recurrent state
    (EngineConfig.kv_block_size's condition)."""
    return not state_bytes_per_sequence(model, torch.float32) and all(type(m) is Attention for m in _kv_modules(model))


@dataclass
class EngineConfig:
    block_size: Optional[int] = None  # tokens per KV block; default: kv_block_size's
    num_blocks: Optional[int] = None  # KV pool size in blocks (V4: the window pool and each entry pool)
    # bytes; default: what max_num_seqs full-length sequences need, at most 1 GiB on a CPU and at most what
    # gpu_memory_utilization leaves on CUDA (device_memory.py)
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the GPU's memory the engine's process may use (vLLM's)
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # tokens per step; default: token_budget's
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    prefix_caching: bool = True
    pack_weights: Optional[bool] = None  # oneDNN pre-packed linears (default: on CPU)
    huge_pages: Optional[bool] = None  # CPU: weights and KV pool on transparent huge pages (default: >= 64 MiB)
    cpu_kernels: Optional[bool] = None  # CPU: megapipe's C++ kernels (kernels.py; default: where they build)
    bf16_linear: str = "auto"  # bf16 matmuls: "own" kernel, "onednn", or "auto" (measured at start: kernels.py)
    max_n: int = 128
    speculative_tokens: int = 0  # drafts per decode step (megapipe.inference.speculative); 0: no speculation
    speculative_method: str = "mtp"  # the drafter: the model's MTP modules, or "ngram" (prompt lookup)
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: the shortest
    max_loras: int = 0  # LoRA adapters resident at once (megapipe.inference.lora); 0: none served
    max_lora_rank: int = 16  # the largest rank an adapter may have
    thread_governor: bool = True  # CPU: steps on one thread while another process competes for the cores (threads.py)

    @property
    def drafter_feature(self) -> Optional[str]:
        """The capability-table engine feature its speculative drafter needs (megapipe/models/capabilities.py), or
        None without speculation."""
        if not self.speculative_tokens:
            return None
        return "ngram_speculative" if self.speculative_method == "ngram" else "speculative"

    def token_budget(self, device) -> int:
        """max_num_batched_tokens, or by default CPU_TOKEN_BUDGET on a CPU and 2048 elsewhere (vLLM's server's):
        a CPU computes a 2048-token prefill chunk in ~0.3 s even for a 135M model, which every running decode then
        waits for; half of it halves that wait and the first tokens of a wave of prompts come sooner, for one more
        pass over the weights per chunk."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_TOKEN_BUDGET if torch.device(device).type == "cpu" else 2048

    def kv_block_size(self, device, plain_attention: bool) -> int:
        """block_size, or by default CPU_BLOCK_SIZE on a CPU where every layer keeping keys is softmax attention
        over the pool (``plain_attention``), else 16. On a CPU a decode row's keys then lie in runs of 128 (16 KB per
        64-dim bf16 kv head) that the cores' own prefetchers follow; in 2 KB blocks anywhere in the pool decode
        attention waits on memory (64 rows x 128 keys read from DRAM: ~470-570 -> ~380 us a layer on Zen 4, the
        engine at 64 running sequences +5%). MLA, compressed entries and recurrent states keep 16."""
        if self.block_size is not None:
            return self.block_size
        return CPU_BLOCK_SIZE if plain_attention and torch.device(device).type == "cpu" else 16

    def check(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if name in ("block_size", "max_num_batched_tokens") and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} = {value!r} must be an integer >= 1")
        if not isinstance(self.speculative_tokens, int) or self.speculative_tokens < 0:
            raise ConfigError(f"--speculative-tokens = {self.speculative_tokens!r} must be an integer >= 0 (0: off)")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-method = {self.speculative_method!r} is not one of "
                              f"{', '.join(SPECULATIVE_METHODS)}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} = {value!r} must be an integer >= 1")
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ConfigError(f"--max-loras = {self.max_loras!r} must be an integer >= 0 (0: no adapters)")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank = {self.max_lora_rank!r} must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"--prompt-lookup-min = {self.prompt_lookup_min} exceeds --prompt-lookup-max = "
                              f"{self.prompt_lookup_max}")
        for name in ("num_blocks", "kv_cache_memory", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{name.replace('_', '-')} = {value!r} must be an integer >= 1")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError(f"--num-blocks = {self.num_blocks} and --kv-cache-memory = {self.kv_cache_memory} bytes "
                              f"both size the KV cache: give one")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"--gpu-memory-utilization = {u!r} must be a number in (0, 1]")
        for name in ("pack_weights", "huge_pages", "cpu_kernels"):
            value = getattr(self, name)
            if value not in (None, True, False):
                raise ConfigError(f"EngineConfig.{name} = {value!r} must be True, False or None (automatic)")
        if self.thread_governor not in (True, False):
            raise ConfigError(f"EngineConfig.thread_governor = {self.thread_governor!r} must be True or False")
        if self.bf16_linear not in kernels.BF16_LINEAR_CHOICES:
            raise ConfigError(f"--bf16-linear = {self.bf16_linear!r} must be one of "
                              f"{', '.join(kernels.BF16_LINEAR_CHOICES)}")


def bad_words_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each bad word's token sequences as vLLM bans them: the word as it is (less leading spaces), and after a space
    where that begins with another token and is as long (a word inside the text)."""
    if tokenizer is None:
        raise ParamError("bad_words", "this model has no tokenizer: bad_words cannot be tokenized")
    found = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip()))
        spaced = list(tokenizer.encode(" " + word.lstrip()))
        if not bare:
            raise ParamError("bad_words", f"bad word {word!r} holds no token")
        found.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    return found


@dataclass
class TextPrompt:
    """A prompt's text with its ids, tokenized by the caller (a server that adds the tokenizer's BOS): the text is
    the output's ``prompt`` (what echo repeats), the ids are what runs."""
    text: str
    ids: list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list]  # per token: (logprob, [(id, logprob), ...] top alternatives)
    finish_reason: Optional[str]  # "stop", "length", "abort" or None while running
    stop_reason: Union[int, str, None] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list]  # None for the first prompt token, then (logprob, alternatives)
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0  # over all samples, stop tokens included (OpenAI's completion_tokens)
    metrics: dict = field(default_factory=dict)


class Completion:
    """What one sample of a request has output besides its tokens (the scheduler's ``Sequence`` holds those): its
    text, the log-probs reported for it, and when its last token came."""

    def __init__(self, detok: Optional[Detokenizer] = None):
        self.detok = detok
        self.logprobs: list = []  # per generated token: (logprob, [(id, logprob), ...])
        self.prompt_logprobs: list = []  # None for the first prompt token, then one per prompt token
        self.stop_reason: Union[int, str, None] = None  # the stop string or stop_token_ids id that ended it (vLLM's)
        self.by_token = False  # a token (EOS, a stop id, the grammar's end) ended it: not part of the output (unless
        # include_stop_str_in_output)
        self.last_token_time: Optional[float] = None


class Request:
    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                 arrival: Optional[float] = None):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.arrival = now() if arrival is None else arrival
        self.seqs: list[Seq] = []
        self.completions: list[Completion] = []  # the output side of each of seqs
        self.first_token_time: Optional[float] = None
        self.first_scheduled_time: Optional[float] = None  # when a step first took it (its queue time ends)
        self.images: Optional[PromptImages] = None  # a vision-language model's images of the prompt
        self.hash_seed: Optional[bytes] = None  # what the prompt's chain of block hashes starts from (its images)
        self.lora: Optional[str] = None  # the LoRA adapter it runs with (megapipe.inference.lora)

    @property
    def finished(self) -> bool:
        return all(s.status == FINISHED for s in self.seqs)


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: Optional[EngineConfig] = None,
                 eos_token_ids: Optional[Sequence[int]] = None):
        self.config = config = config or EngineConfig()
        config.check()
        cfg = model.cfg
        self.model_config = cfg
        if cfg.num_labels:
            raise ConfigError("the model is a reward model (model.num_labels = 1): it scores sequences (megapipe serve "
                              "answers /pooling, posttrain rl --reward-model) and does not generate")
        if "paged_kv" not in capabilities(cfg).engine:
            raise MegapipeError(f"the decoding engine does not support {describe(cfg)} models yet "
                                "(megapipe/models/capabilities.py)")
        self.tokenizer = tokenizer
        eos = list(eos_token_ids if eos_token_ids is not None else eos_ids_of(None, tokenizer))
        self.vocab_size = cfg.vocab_size
        self.special = special_ids(tokenizer) if tokenizer is not None else frozenset()
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"--max-model-len = {self.max_model_len} exceeds the model's max_position_embeddings"
                              f" = {cfg.max_position_embeddings}")
        ngram = config.drafter_feature == "ngram_speculative"
        if ngram and "ngram_speculative" not in capabilities(cfg).engine:
            raise ConfigError(f"--speculative-method ngram verifies drafts by computing them and rolling back the "
                              f"rejected ones, which the recurrent state of this {describe(cfg)} model cannot take")
        if config.max_loras and "multi_lora" not in capabilities(cfg).engine:
            raise ConfigError(f"serving LoRA adapters (--max-loras / --lora-modules) does not support {describe(cfg)} "
                              f"models yet (megapipe/models/capabilities.py)")
        if config.speculative_tokens and not ngram and "speculative" not in capabilities(cfg).engine:
            why = (f"which {describe(cfg)} models cannot draft with yet (megapipe/models/capabilities.py)"
                   if cfg.mtp_depth else f"and this {describe(cfg)} model has none (model.mtp_num_layers)")
            raise ConfigError(f"--speculative-tokens {config.speculative_tokens} drafts with the model's multi-token "
                              f"prediction modules, {why}")
        model.eval()
        p = next(model.parameters())
        self.token_budget = budget = config.token_budget(p.device)
        # the Mamba layers' recurrent state of the sequences decoded at once (hybrid models; empty otherwise)
        max_num_seqs = self._state_slots(model, config, p.dtype)
        self.states = StatePool(model, max_num_seqs, p.dtype, p.device)
        state_bytes = self.states.bytes_per_sequence() * max_num_seqs
        # keys and values of the layers that attend (a hybrid model's Mamba and MLP layers have none); speculative
        # decoding: the MTP blocks' too (pool layers num_layers + depth - 1)
        kv_layers = sorted({m.layer_id for m in _kv_modules(model)})
        bs = config.kv_block_size(p.device, plain_attention(model))
        evict = eviction_window(cfg)  # every layer windowed: the blocks behind it are given back
        if config.speculative_tokens and not ngram:
            kv_layers += range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth)
            if evict is not None:  # ... behind what the MTP blocks read (MTPSpeculator.reach) and one more key
                evict = evict * cfg.mtp_depth + 1
        per_block = KVPool.bytes_per_block(len(kv_layers), bs, dtype=p.dtype, **kv_layout(cfg))
        # windowed layers beside full ones (GPT-OSS): blocks of their own, in a table of their own that gives back
        # what falls behind the window, so they need only enough for every sequence's window and a step's chunks
        window = split_window(cfg)
        windowed = [i for i in kv_layers if window is not None and layer_windows(cfg).get(i) is not None]
        per_windowed = KVPool.bytes_per_block(len(windowed), bs, dtype=p.dtype, **kv_layout(cfg))
        windowed_need = (max_num_seqs * (-(-(window or 0) // bs) + 2)
                         + -(-budget // bs)) if windowed else 0
        num_blocks = windowed_blocks = config.num_blocks
        # DeepSeek-V4: its compressed entries paged per rate beside the window's keys (compressed_cache), each pool
        # --num-blocks blocks, or sized out of the memory by what it needs per sequence
        entry_bytes = compressed_cache.entry_bytes(model, p.dtype)
        entry_blocks = dict.fromkeys(entry_bytes, num_blocks)
        if num_blocks is None and entry_bytes:
            num_blocks, entry_blocks = compressed_cache.pool_blocks(
                entry_bytes, config.kv_cache_memory, state_bytes, per_block, evict, max_num_seqs,
                self.max_model_len, bs, budget, GiB)
        elif num_blocks is None:
            want = max_num_seqs * ((self.max_model_len + bs - 1) // bs)
            memory = config.kv_cache_memory
            if memory is None:
                wanted = want * (per_block - per_windowed) + windowed_need * per_windowed
                memory = self._default_kv_memory(model, config, p, wanted, -(-self.max_model_len // bs) * per_block,
                                                 budget, max_num_seqs) + state_bytes
            elif memory < state_bytes:
                raise ConfigError(f"--kv-cache-memory = {memory} bytes does not hold the recurrent state of "
                                  f"--max-num-seqs {config.max_num_seqs} sequences ({state_bytes} bytes): give more "
                                  f"memory or fewer sequences")
            num_blocks = windowed_blocks = (memory - state_bytes) // per_block if per_block else want
            if windowed and num_blocks > windowed_need:  # the windowed layers' share beyond their need to the rest
                windowed_blocks = windowed_need
                num_blocks = (memory - state_bytes - windowed_need * per_windowed) // (per_block - per_windowed)
        if num_blocks * bs < self.max_model_len and not (entry_bytes and config.num_blocks is None):
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks of {bs} tokens ({num_blocks * bs} tokens) but one sequence of"
                f" --max-model-len {self.max_model_len} needs {-(-self.max_model_len // bs)}: give more "
                f"--kv-cache-memory / --num-blocks or a smaller --max-model-len")
        try:
            entries = compressed_cache.EntryPool(model, entry_blocks, bs, p.dtype, p.device) if entry_bytes else None
            self.pool = KVPool(kv_layers, num_blocks, bs, dtype=p.dtype, device=p.device, **kv_layout(cfg),
                               windowed_layers=windowed, windowed_blocks=windowed_blocks if windowed else 0,
                               entries=entries)
        except (RuntimeError, MemoryError) as e:  # torch's CPU allocator and CUDA's out-of-memory are RuntimeErrors
            if "alloc" not in str(e).lower() and "out of memory" not in str(e).lower():
                raise
            raise ConfigError(f"cannot allocate the KV cache of {num_blocks} blocks ({num_blocks * per_block / GiB:.1f}"
                              f" GiB) on {p.device}: give a smaller --kv-cache-memory / --num-blocks") from None
        # off where the capability table says so (a recurrent state is not cut at block boundaries: state_cache)
        self.prefix_caching = config.prefix_caching and "prefix_caching" in capabilities(cfg).engine
        self.blocks = BlockManager(num_blocks, bs, self.prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, budget,
                                   self._lookahead if config.speculative_tokens else None, self.states,
                                   window if windowed else evict,
                                   BlockManager(windowed_blocks, bs, self.prefix_caching) if windowed else None,
                                   self._admit if config.max_loras else None,
                                   {r: BlockManager(n, bs, False) for r, n in entry_blocks.items()})
        self.runner = ModelRunner(model, self.pool, config.pack_weights, config.huge_pages,
                                  config.cpu_kernels, self.states, config.bf16_linear, eos)
        self.adapters = AdapterSlots(model, config.max_loras, config.max_lora_rank) if config.max_loras else None
        self.runner.adapters = self.adapters
        self.speculator = None
        if ngram:
            self.speculator = NgramSpeculator(config.speculative_tokens, self.runner.sample_row,
                                              config.prompt_lookup_max, config.prompt_lookup_min)
        elif config.speculative_tokens:
            self.speculator = MTPSpeculator(self.runner, config.speculative_tokens, self.runner.sample_row)
        self.runner.speculator = self.speculator
        self.device = p.device
        self.governor = ThreadGovernor() if config.thread_governor and p.device.type == "cpu" else None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = 0  # computed prompt tokens (prefix-cache hits excluded)
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # steps per bucket of tokens (+Inf last)
        self.iteration_tokens_sum = 0
        self._grammars = None
        self.detokenize = True  # False: outputs carry token ids only, no text or stop strings (its front end's job)

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a sequence (unless ignore_eos); the runner's, which suppresses them before min_tokens."""
        return self.runner.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Sequence[int]) -> None:
        self.runner.eos_token_ids = list(ids)

    @property
    def grammars(self):
        """Structured outputs' compiled grammars for this engine's tokenizer (megapipe.inference.structured)."""
        if self._grammars is None:
            from megapipe.inference.structured import Grammars

            if self.tokenizer is None:
                raise ParamError("response_format", "structured outputs need a tokenizer, and this engine has none")
            self._grammars = Grammars.for_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    @staticmethod
    def _default_kv_memory(model, config: EngineConfig, p: torch.Tensor, wanted: int, minimum: int, budget: int,
                           max_num_seqs: int) -> int:
        """The KV cache's bytes without --kv-cache-memory / --num-blocks: what ``wanted`` (max_num_seqs sequences of
        max_model_len), at most 1 GiB on a CPU and at most --gpu-memory-utilization of the GPU's memory less what is
        in use and a step's activations on CUDA (device_memory.py), said once there."""
        if p.device.type != "cuda":
            return min(wanted, GiB)
        rows = min(max_num_seqs * (1 + config.speculative_tokens), budget)
        reserve = device_memory.step_reserve(model.cfg.hidden_size, widest_linear(model)[0], model.cfg.vocab_size,
                                             budget, rows, p.element_size())
        memory = device_memory.kv_memory_on_gpu(p.device, config.gpu_memory_utilization, reserve, wanted, minimum)
        say_once(f"KV cache: {memory / GiB:.2f} GiB on {p.device} (--gpu-memory-utilization "
                 f"{config.gpu_memory_utilization}: {reserve / GiB:.2f} GiB kept for a step's activations"
                 f"{'; all that --max-num-seqs sequences of --max-model-len need' if memory == wanted else ''})")
        return memory

    @staticmethod
    def _state_slots(model, config: EngineConfig, dtype: torch.dtype) -> int:
        """How many sequences run at once: --max-num-seqs, unless the default memory (no --kv-cache-memory) cannot
        hold that many recurrent states (an 8B hybrid's are ~100 MiB per sequence): then as many as STATE_MEMORY
        holds, said once."""
        per_sequence = state_bytes_per_sequence(model, dtype)
        if not per_sequence or config.kv_cache_memory is not None:
            return config.max_num_seqs
        fit = max(1, STATE_MEMORY // per_sequence)
        if fit < config.max_num_seqs:
            say_once(f"the recurrent state of --max-num-seqs {config.max_num_seqs} sequences would take "
                     f"{per_sequence * config.max_num_seqs / GiB:.1f} GiB ({per_sequence / 2**20:.1f} MiB each): "
                     f"decoding {fit} at once (set --kv-cache-memory to choose)")
            return fit
        return config.max_num_seqs

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], device=None, dtype=None, **config) -> "LLMEngine":
        loaded = load_model(path, resolve_device(device), resolve_dtype(dtype))
        return cls(loaded.model, loaded.tokenizer, EngineConfig(**config), loaded.eos_ids)

    # ----------------------------------------------------------------------------------------------- requests

    def encode(self, prompt: Union[str, Sequence[int], TextPrompt]) -> tuple[Optional[str], list[int]]:
        """A prompt's (text or None, ids): a text is tokenized without special tokens (a chat template writes its
        own); ids run as they are."""
        if isinstance(prompt, TextPrompt):
            return prompt.text, list(prompt.ids)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "this engine has no tokenizer: give prompts as token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, [int(t) for t in prompt]

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        """Validate a request before it is queued; returns params with max_tokens resolved (none, or more than the
        context has room for after the prompt: that room, as vLLM's server cuts it; more than the whole context is
        refused, as there)."""
        params.validate(self.vocab_size, self.config.max_n)
        if params.bad_words and not params.bad_words_ids:
            params = replace(params, bad_words_ids=bad_words_ids(self.tokenizer, params.bad_words))
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a cache hit when the server compiled it beforehand
        if not prompt_ids:
            raise ParamError("prompt", "the prompt is empty (it must hold at least one token)")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        limit, n = self.max_model_len, len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > limit:  # vLLM's: more than the context can ever hold
            raise ParamError("max_tokens", f"max_tokens = {params.max_tokens} cannot be greater than this model's "
                                           f"maximum context length, {limit} tokens")
        if n >= limit:
            raise ParamError("prompt", f"This model's maximum context length is {limit} tokens. However, your "
                                       f"request has {n} input tokens, which leaves none to generate. Please reduce "
                                       f"the length of the prompt.")
        room = limit - n  # as vLLM's server: max_tokens (or its default) is cut to what the context has room for
        if params.max_tokens is None or params.max_tokens > room:
            params = replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        return params

    def add_request(self, request_id: str, prompt: Union[str, Sequence[int]], params: SamplingParams,
                    arrival: Optional[float] = None, images: Union[dict, PromptImages, None] = None,
                    lora: Optional[str] = None) -> Request:
        """Queue a request; ``arrival`` (time.monotonic) counts from when a server received it; ``images``: the
        image processor's ``pixel_values`` and ``image_grid_thw`` of the images whose tokens the prompt holds (or
        their PromptImages, made and checked by the caller); ``lora``: the name of a registered LoRA adapter to run
        it with."""
        if request_id in self.requests:
            raise ParamError("request_id", f"request id {request_id!r} is already running")
        if lora is not None and lora not in self.lora_adapters():
            raise ParamError("model", f"no LoRA adapter {lora!r} is loaded (loaded: "
                                      f"{', '.join(self.lora_adapters()) or 'none'})")
        text, ids = self.encode(prompt)
        params = self.check_request(ids, params)
        req = Request(request_id, text, ids, params, arrival)
        if isinstance(images, dict):
            images = PromptImages(self.model_config, ids, images["pixel_values"], images["image_grid_thw"])
        if images is not None:
            req.images = images
            req.hash_seed = req.images.hash_seed
        req.lora = lora
        if lora is not None:  # KV computed under another adapter is never reused
            req.hash_seed = (req.hash_seed or b"") + self.adapters.registered[lora].uid
        first = None
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            gen = None
            if not params.greedy and seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed)
            seq = Seq(next(self._ids), req, i, params, gen)
            detok = None
            if self.tokenizer is not None and self.detokenize:
                detok = Detokenizer(self.tokenizer, ids, self.special if params.skip_special_tokens else frozenset(),
                                    params.stop, params.include_stop_str_in_output)
            req.completions.append(Completion(detok))
            if params.structured is not None:
                seq.matcher = self.grammars.matcher(params.structured)
            seq.after = first
            first = first or seq
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str, index: Optional[int] = None) -> Optional[RequestOutput]:
        """Finish the request's unfinished samples as aborted (their blocks freed) and return its last output; with
        ``index`` only that sample (an engine core's front end ended it on a stop string), and None while its siblings
        run on."""
        if index is not None:
            req = self.requests.get(request_id)
            if req is None or index >= len(req.seqs):
                return None
            if req.seqs[index].status != FINISHED:
                self.scheduler.finish(req.seqs[index], "abort")
            if not req.finished:
                return None
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.status != FINISHED:
                self.scheduler.finish(seq, "abort")
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ----------------------------------------------------------------------------------------------- stepping

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduling + model step; returns an output for every request that progressed (or finished)."""
        plan = self.scheduler.schedule()
        if plan.empty:
            if not plan.preempted and (self.scheduler.running or self.scheduler.waiting):
                raise self._stalled()
            return []
        self.num_steps += 1
        t = now()
        for seq in plan.new:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = t
        with self.governor.step() if self.governor is not None else contextlib.nullcontext():
            result = self.runner.execute(plan)
        outputs = self.update_from_output(plan, result)
        tokens = sum(plan.num_scheduled_tokens.values())
        self.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, tokens)] += 1
        self.iteration_tokens_sum += tokens
        return outputs

    def update_from_output(self, plan: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Apply a step: the sequences' computed counts advance (their new full blocks offered to the prefix cache,
        blocks of rejected drafts returned), prompt logprobs and sampled tokens are recorded, stop conditions
        finish sequences (their blocks freed); returns an output for every request that progressed. On the engine,
        not the scheduler: a stop string is found on the detokenized text, which is the request's, not the
        scheduler's."""
        for seq in plan.decodes:
            if seq.seq_id not in result.num_accepted:  # a verified one advances by what was accepted, below
                seq.num_computed += 1
                self.scheduler.register_computed(seq)
        for seq, n in plan.chunks:
            if seq.num_computed < seq.prompt_len:
                self.num_prompt_tokens += min(n, seq.prompt_len - seq.num_computed)
            seq.num_computed += n
            self.scheduler.register_computed(seq)
            if seq.seq_id in result.prompt_logprobs:
                self._prompt_logprobs(seq, *result.prompt_logprobs[seq.seq_id])
        seqs = {s.seq_id: s for s in plan.decodes}
        seqs.update((s.seq_id, s) for s, _ in plan.chunks)
        touched, t = {}, now()
        for seq_id, tokens in result.sampled.items():
            seq = seqs[seq_id]
            logprobs = result.logprobs.get(seq_id)
            verified = seq_id in result.num_accepted
            if verified:
                seq.num_computed += len(tokens)  # tokens[num_computed] and the accepted drafts
            for i, token in enumerate(tokens):
                if verified and i == len(tokens) - 1:  # the accepted drafts are tokens now: their blocks can be cached
                    self.scheduler.register_computed(seq)
                    self.scheduler.rollback(seq)
                if logprobs is not None:
                    seq.request.completions[seq.index].logprobs.append(logprobs[i])
                self._append(seq, token, t)
                if seq.status == FINISHED:
                    break
            touched[seq.request.request_id] = seq.request
        for seq, _ in plan.chunks:  # a chunk that did not finish the prompt still counts as progress (prompt logprobs)
            touched.setdefault(seq.request.request_id, seq.request)
        outs = []
        for req in touched.values():
            out = self._output(req)
            if req.finished:
                self.requests.pop(req.request_id, None)
            outs.append(out)
        return outs

    def _stalled(self) -> EngineStalled:
        s = self.scheduler
        first = (s.running or list(s.waiting))[0]
        return EngineStalled(
            f"the engine made no progress: {len(s.running)} running and {len(s.waiting)} waiting sequences but "
            f"nothing scheduled (first: {len(first.tokens)} tokens, {first.num_computed} computed, "
            f"{len(first.block_ids)} blocks; {self.blocks.num_free()} of {self.blocks.num_blocks} blocks free)")

    @staticmethod
    def _prompt_logprobs(seq: Seq, start: int, entries: list) -> None:
        """Record entries for prompt tokens start + 1 .. (a sequence recomputed after a preemption has some)."""
        kept = seq.request.completions[seq.index].prompt_logprobs
        if not kept:
            kept.append(None)  # the first prompt token has no context
        kept.extend(entries[max(0, len(kept) - 1 - start):])

    # ----------------------------------------------------------------------------------------------- LoRA adapters

    def lora_adapters(self) -> dict[str, str]:
        """Registered adapters: name -> the path it was read from."""
        return {n: a.path for n, a in self.adapters.registered.items()} if self.adapters is not None else {}

    def add_lora(self, name: str, path, rank: int, scale: float, weights: dict, replace: bool = False) -> None:
        """Register adapter ``name`` (``read_adapters(path, cfg)``'s rank, scale and weights); loaded into a slot
        when a request for it is admitted. ``replace``: new weights for a registered ``name`` (vLLM's
        load_inplace)."""
        if self.adapters is None:
            raise ConfigError("this engine serves no LoRA adapters: start it with --max-loras >= 1")
        if name in self.adapters.registered and not replace:
            raise ParamError("lora_name", f"a LoRA adapter named {name!r} is already loaded")
        if name in self.adapters.registered:
            self.adapters.replace(name, path, rank, scale, weights)
        else:
            self.adapters.register(name, path, rank, scale, weights)

    def load_lora(self, name: str, path) -> None:
        """Read the adapter at ``path`` (a peft directory or a megapipe LoRA run) and register it as ``name``."""
        from megapipe.checkpoint.hf.peft import read_adapters

        self.add_lora(name, path, *read_adapters(path, self.model_config))

    def remove_lora(self, name: str) -> None:
        if name not in self.lora_adapters():
            raise ParamError("lora_name", f"no LoRA adapter {name!r} is loaded")
        users = sum(1 for r in self.requests.values() if r.lora == name)
        if users:
            raise ParamError("lora_name", f"LoRA adapter {name!r} serves {users} request(s) in flight: unload it "
                                          f"when they have finished")
        self.adapters.unregister(name)

    def _admit(self, seq: Seq) -> bool:
        """A waiting sequence may start when its adapter is resident or can be loaded into a slot no running
        sequence holds."""
        name = seq.request.lora
        return name is None or self.adapters.acquire(name, {s.request.lora for s in self.scheduler.running})

    def _lookahead(self, seq: Seq) -> int:
        """Drafts worth verifying for ``seq`` this step: no more than its max_tokens and the context can take; none
        for a sequence with structured output (drafts are not checked against its grammar)."""
        if seq.matcher is not None:
            return 0
        room = min(seq.params.max_tokens + seq.prompt_len, self.max_model_len) - len(seq.tokens) - 1
        return max(0, min(self.config.speculative_tokens, room))

    def _append(self, seq: Seq, token: int, t: float) -> None:
        """Append a sampled token to ``seq`` and its completion's text; finish the sequence where a stop condition
        holds."""
        p, req = seq.params, seq.request
        done = req.completions[seq.index]
        seq.tokens.append(token)
        self.num_generation_tokens += 1
        if seq.matcher is not None:
            seq.matcher.accept(token)
        if req.first_token_time is None:
            req.first_token_time = t
        done.last_token_time = t
        n_out = len(seq.tokens) - seq.prompt_len
        reason, stop_reason = None, None
        eos = not p.ignore_eos and token in self.eos_token_ids
        if eos or token in p.stop_token_ids or (
                seq.matcher is not None and seq.matcher.terminated):  # a grammar's end ends it, ignore_eos or not
            reason, stop_reason = "stop", token if token in p.stop_token_ids and not eos else None  # EOS: None
            # include_stop_str_in_output keeps the ending token in the output, its text too (vLLM's rule)
            done.by_token = not p.include_stop_str_in_output
            if not done.by_token and done.detok is not None:
                done.detok.add(token)
        elif done.detok is not None:
            new = done.detok.add(token)
            if n_out >= p.min_tokens:
                hit = done.detok.find_stop(new)
                if hit is not None:
                    done.detok.stop_at(hit, p.include_stop_str_in_output)
                    reason, stop_reason = "stop", hit[1]
        if reason is None and (n_out >= p.max_tokens or len(seq.tokens) >= self.max_model_len):
            reason = "length"
            if done.detok is not None:
                done.detok.flush()
        if reason is not None:
            done.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        generated = 0
        for seq, done in zip(req.seqs, req.completions, strict=True):
            ids = seq.output_ids
            generated += len(ids)
            lps = done.logprobs if seq.params.logprobs is not None else None
            if seq.finish_reason == "stop" and done.by_token:
                ids = ids[:-1]  # the EOS / stop token ends the sequence but is not part of it
                lps = lps[:len(ids)] if lps is not None else None
            finished = seq.status == FINISHED
            text = done.detok.stable_text(finished) if done.detok is not None else ""
            outs.append(CompletionOutput(seq.index, text, ids, lps, seq.finish_reason, done.stop_reason))
        first = req.completions[0]
        metrics = {"arrival_time": req.arrival, "first_scheduled_time": req.first_scheduled_time,
                   "first_token_time": req.first_token_time,
                   "last_token_time": max((c.last_token_time or 0.0) for c in req.completions) or None,
                   "num_preemptions": sum(seq.preemptions for seq in req.seqs),
                   "max_sample_tokens": max(len(seq.output_ids) for seq in req.seqs)}
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids,
                             (first.prompt_logprobs or [None]) if req.params.prompt_logprobs is not None else None,
                             outs, req.finished, req.seqs[0].num_cached, generated, metrics)

    # ----------------------------------------------------------------------------------------------- batch API

    def generate(self, prompts: Sequence[Union[str, Sequence[int]]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 images: Optional[Sequence[Optional[dict]]] = None) -> list[RequestOutput]:
        """Run every prompt to completion (all in one continuous batch); outputs in prompt order. ``images``: each
        prompt's (None, or as ``add_request`` takes them)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise MegapipeError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise MegapipeError(f"{len(prompts)} prompts but {len(images)} entries of images")
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        return [out for _, out in self.run_to_completion(list(zip(ids, prompts, params, images, strict=True)))]

    def run_to_completion(self, requests: Sequence[tuple]) -> list[tuple[Request, RequestOutput]]:
        """Add every (request_id, prompt, params[, images]), step until all have finished, and return each request
        with its final output, in the given order; the requests are aborted on the way out (an error included)."""
        added: list[Request] = []
        try:
            for rid, prompt, p, *images in requests:
                added.append(self.add_request(rid, prompt, p, images=images[0] if images else None))
            done: dict[str, RequestOutput] = {}
            while len(done) < len(added):
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
        finally:
            for req in added:
                self.abort(req.request_id)
        return [(req, done[req.request_id]) for req in added]

    def load_weights(self, state: dict) -> None:
        """New weights for the model (e.g. the trainer's after an update; full, unsharded, any dtype). Cached
        prefixes were computed with the old weights, so the prefix cache is emptied; requests in flight continue
        with the new weights for the tokens not yet computed."""
        self.runner.load_weights(state)
        for blocks in (self.blocks, self.scheduler.window_blocks):
            if blocks is not None:
                blocks.reset_prefix_cache()

    def kv_cache_line(self) -> str:
        """The pool for the startup line: its blocks, and the bytes a token takes in it next to the per-head keys and
        values of the same attention (its GQA equivalent: a latent cache's decompressed form); a hybrid model's
        recurrent state bytes per sequence (Mamba layers' conv windows and SSM states) and its slots. DeepSeek-V4:
        its entry blocks per rate, and the bytes a token takes at --max-model-len tokens of context (the window's keys
        and the entries, as ``plan`` counts them)."""
        pool, cfg = self.pool, self.model_config
        stored = pool.bytes_per_token()
        line = f"{pool.num_blocks} KV blocks of {pool.block_size}, {stored} KV bytes/token"
        if pool.entries is not None:
            stored = compressed_cache.kv_bytes_per_token(pool, eviction_window(cfg), self.max_model_len)
            blocks = ", ".join(f"{n} at rate {r}" for r, n in sorted(pool.entries.num_blocks.items()))
            line = (f"{pool.num_blocks} KV blocks of {pool.block_size} (the window's keys) and entry blocks of "
                    f"{pool.block_size} ({blocks}), {stored:.1f} KV bytes/token at {self.max_model_len} tokens")
        if pool.windowed_layers:
            line += f" ({pool.windowed_blocks} blocks for the windowed layers)"
        # per pool layer, so a pool with more layers than the model's (MTP modules' blocks) compares alike
        attending = attention_layers(cfg)
        equivalent = (kv_cache_values_per_token(cfg)[1] * pool.num_layers // attending * pool.element_size
                      if attending else 0)
        if equivalent != stored:
            line = f"{line} (GQA equivalent {equivalent}, {equivalent / stored:.1f}x)"
        if self.states:
            line += f", {self.states.bytes_per_sequence()} state bytes/sequence x {self.states.num_slots} sequences"
        return line

    def kv_cache_usage(self) -> float:
        """The fraction of the KV memory sequences hold: the block pool's, with DeepSeek-V4's entry pools weighed
        by their bytes."""
        pool = self.pool
        per_block = pool.bytes_per_block(pool.num_layers, pool.block_size, pool.kv_heads, pool.head_dim, pool.dtype,
                                         pool.latent)
        parts = [(self.blocks, per_block)]
        parts += [(b, pool.entries.bytes_per_block(r)) for r, b in self.scheduler.entry_blocks.items()]
        total = sum(b.num_blocks * size for b, size in parts)
        return sum((b.num_blocks - b.num_free()) * size for b, size in parts) / total if total else 0.0

    def stats(self) -> dict:
        return {"running": self.num_running(), "waiting": self.num_waiting(), "kv_cache_usage": self.kv_cache_usage(),
                "prefix_cache_queries": self.blocks.query_tokens, "prefix_cache_hits": self.blocks.hit_tokens,
                "prefix_cache_hit_rate": self.blocks.hit_rate(), "num_blocks": self.blocks.num_blocks,
                "preemptions": self.scheduler.num_preemptions, "prompt_tokens": self.num_prompt_tokens,
                "generation_tokens": self.num_generation_tokens, "waiting_deferred": self.scheduler.num_deferred(),
                "iteration_tokens": list(self.iteration_tokens), "iteration_tokens_sum": self.iteration_tokens_sum,
                **(self.speculator.stats() if self.speculator is not None else {}), **self._lora_stats()}

    def cache_info(self) -> dict[str, str]:
        """vLLM's cache_config_info labels, those that hold here (the KV cache is in the model's dtype: auto)."""
        cfg = self.config
        return {"block_size": str(self.pool.block_size), "cache_dtype": "auto",
                "enable_prefix_caching": str(self.prefix_caching),
                "gpu_memory_utilization": str(cfg.gpu_memory_utilization), "num_gpu_blocks": str(self.pool.num_blocks),
                "num_gpu_blocks_override": str(cfg.num_blocks), "num_cpu_blocks": "None"}

    def _lora_stats(self) -> dict:
        """vLLM's lora_requests_info: the adapters of the running and of the waiting requests."""
        if self.adapters is None:
            return {}
        s = self.scheduler
        return {"max_lora": self.adapters.max_loras,
                "running_lora_adapters": sorted({q.request.lora for q in s.running if q.request.lora}),
                "waiting_lora_adapters": sorted({q.request.lora for q in s.waiting if q.request.lora})}
