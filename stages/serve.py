"""``megapipe serve CKPT|HF_DIR``: an OpenAI-compatible server on megapipe's engine, or on vLLM (``--engine vllm``)."""

from __future__ import annotations

import signal
import sys
from typing import List, Optional

import typer

from megapipe.errors import MegapipeError
from stages.common import (
    PROMPT_LOOKUP_MAX,
    PROMPT_LOOKUP_MIN,
    SPECULATIVE_METHOD,
    SPECULATIVE_TOKENS,
    speculative_fields,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
# the defaults of the server's own limits, which vLLM's server has no flags for (named when given with --engine vllm)
MAX_QUEUE, MAX_BODY_SIZE, MAX_IMAGE_SIZE, MAX_IMAGE_PIXELS = 256, "8MiB", "20MiB", 4096 * 4096


def serve(
    model: str = typer.Argument(..., help="Checkpoint directory, run directory (its latest) or Hugging Face model dir."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0 exposes the server)."),
    port: int = typer.Option(8000, "--port", help="Port (0: any free port, printed when ready)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MEGAPIPE_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every route but /health."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="The model name clients ask for (default: the path's name)."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Most sequences in one batch."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len",
                                                help="Context limit, prompt + completion (default: the model's)."),
    max_queue: int = typer.Option(MAX_QUEUE, "--max-queue", help="Most waiting requests; more get 503 (0: no limit)."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout",
                                           help="On SIGTERM, seconds in-flight requests get to finish (then a 503 shutting_down)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (as stored), float32, bfloat16 or float16."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...; default: cuda if present."),
    engine: str = typer.Option("megapipe", "--engine", help="megapipe (own engine) or vllm."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", envvar="MEGAPIPE_VLLM_PYTHON",
                                              help="Python of a vLLM environment (tools/setup_vllm_cpu.sh)."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory",
                                                  help="KV-cache pool size, e.g. 2GiB (default: what the batch needs, "
                                                       "at most 1 GiB)."),
    num_blocks: Optional[int] = typer.Option(None, "--num-blocks", help="KV-cache pool size in blocks instead."),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, "--gpu-memory-utilization", help="On a GPU, the share of its memory the server may use; the KV cache "
                                               "gets what the weights and a step leave of it (default 0.9)."),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="Tokens per KV-cache block (default: 128 on a CPU where every layer is softmax "
                                   "attention, as vLLM's CPU backend; 16 elsewhere)."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, "--max-num-batched-tokens", help="Token budget of one engine step (prefill is chunked to it; default "
                                               "1024 on a CPU, 2048 on a GPU; vLLM: its own default)."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Do not reuse cached prompt blocks."),
    speculative_tokens: int = SPECULATIVE_TOKENS,
    speculative_method: Optional[str] = SPECULATIVE_METHOD,
    prompt_lookup_max: Optional[int] = PROMPT_LOOKUP_MAX,
    prompt_lookup_min: Optional[int] = PROMPT_LOOKUP_MIN,
    lora_modules: Optional[List[str]] = typer.Option(
        None, "--lora-modules", help="LoRA adapters served beside the base model, name=PATH each (a peft directory or a "
                                     "megapipe LoRA run); clients choose one by its name as the model."),
    max_loras: Optional[int] = typer.Option(None, "--max-loras",
                                            help="LoRA adapters resident at once, the rest loaded when asked (least "
                                                 "recently used out; default: as many as --lora-modules)."),
    max_lora_rank: int = typer.Option(16, "--max-lora-rank", help="The largest rank of a served LoRA adapter."),
    tool_call_parser: Optional[str] = typer.Option(None, "--tool-call-parser",
                                                   help="How tool_choice auto finds calls in the output: hermes, "
                                                        "llama3_json or openai (GPT-OSS harmony)."),
    reasoning_parser: Optional[str] = typer.Option(None, "--reasoning-parser",
                                                   help="Where chat replies' reasoning_content comes from: "
                                                        "deepseek_r1 or qwen3 (<think> ... </think>); GPT-OSS "
                                                        "harmony's channels need none."),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice",
                                                 help="vLLM's flag for tool_choice auto: accepted, and needs "
                                                      "--tool-call-parser (which alone turns auto on here)."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="The chat template: chatml, llama3, harmony, one of the "
                                                     "tokenizer's named templates, a .jinja file or the template "
                                                     "itself (default: the tokenizer's)."),
    generation_config: str = typer.Option("auto", "--generation-config",
                                          help="Sampling defaults for fields a request leaves out: auto (the "
                                               "model's generation_config.json, as vLLM), vllm (none) or a "
                                               "directory holding a generation_config.json."),
    allowed_origins: Optional[List[str]] = typer.Option(None, "--allowed-origins",
                                                        help="Origins browsers may call from (CORS), e.g. '*'; "
                                                             "repeat or give a JSON list (default: none)."),
    max_body_size: str = typer.Option(MAX_BODY_SIZE, "--max-body-size", help="Largest request body; larger get 413."),
    max_image_size: str = typer.Option(MAX_IMAGE_SIZE, "--max-image-size",
                                       help="Largest image (encoded) in a chat request; larger get 400."),
    max_image_pixels: int = typer.Option(MAX_IMAGE_PIXELS, "--max-image-pixels",
                                         help="Most pixels (width x height) of an image in a chat request."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice)."),
    no_engine_process: bool = typer.Option(False, "--no-engine-process",
                                           help="Run the engine in a thread of the server's process (debugging), not "
                                                "in an engine-core process of its own."),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve a model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models,
    /metrics."""
    from pathlib import Path

    from megapipe.omp import prefer_bounded_spin

    if engine == "megapipe":  # vLLM's process keeps vLLM's own OpenMP defaults
        prefer_bounded_spin()  # before torch loads OpenMP
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint.hf.files import parse_size

    _check_api_key(api_key)
    if engine not in ("megapipe", "vllm"):
        raise MegapipeError(f"--engine {engine!r} is not one of megapipe, vllm")
    if max_image_pixels < 1:
        raise MegapipeError(f"--max-image-pixels = {max_image_pixels} must be >= 1")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise MegapipeError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or openai)")
    origins = _origins(allowed_origins or [])
    # lazy: the parsers' own lookups refuse an unknown name (ParamError, a MegapipeError), before anything loads
    from megapipe.inference.reasoning import reasoning_parser_for
    from megapipe.inference.tool_calls import parser_for

    reasoning_parser_for(reasoning_parser)
    parser_for(tool_call_parser)
    if log_level.lower() not in LOG_LEVELS:
        raise MegapipeError(f"--log-level {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    if max_queue < 0:
        raise MegapipeError(f"--max-queue = {max_queue} must be >= 0 (0: no limit)")
    if not 0 <= shutdown_timeout < float("inf"):
        raise MegapipeError(f"--shutdown-timeout = {shutdown_timeout} must be a number of seconds >= 0")
    if not host.strip():
        raise MegapipeError("--host is empty, which would listen on every interface: say --host 0.0.0.0 to mean that")
    if not 0 <= port <= 65535:
        raise MegapipeError(f"--port = {port} is not a port number (0-65535)")
    name = served_model_name or Path(model).expanduser().resolve().name
    loras = _lora_modules(lora_modules or [])
    if name in loras:
        raise MegapipeError(f"--lora-modules names {name!r}, the base model's name: give the adapter another")
    spec = dict(max_loras=len(loras) if max_loras is None else max_loras, max_lora_rank=max_lora_rank,
                speculative_tokens=speculative_tokens,
                **speculative_fields(speculative_method, speculative_tokens, prompt_lookup_max, prompt_lookup_min))
    memory = parse_size(kv_cache_memory, "--kv-cache-memory") if kv_cache_memory else None
    # one EngineConfig, checked by the engine's own rules before anything loads (vLLM's flags included)
    from megapipe.inference.engine import EngineConfig

    engine_config = EngineConfig(
        block_size=block_size, num_blocks=num_blocks, kv_cache_memory=memory, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        prefix_caching=not no_prefix_caching, **spec)
    if gpu_memory_utilization is not None:
        engine_config.gpu_memory_utilization = gpu_memory_utilization
    engine_config.check()
    if not Path(model).expanduser().exists():
        raise MegapipeError(f"{model} does not exist (give a checkpoint, a run directory or a Hugging Face model dir)")

    if engine == "vllm":
        import os

        # lazy: imports torch; megapipe --help stays fast
        from megapipe.inference.vllm_engine import hf_dir_for, run_vllm, vllm_command
        from megapipe.inference.vllm_engine import vllm_python as find_python

        python = find_python(vllm_python)
        hf_dir = hf_dir_for(model)
        env = dict(os.environ)
        if memory is not None:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(memory / 2**30))))
        template = _chat_template(chat_template, hf_dir) if chat_template is not None else None
        not_peft = [f"{n}={p}" for n, p in loras.items() if not (Path(p).expanduser() / "adapter_config.json").is_file()]
        if not_peft:
            raise MegapipeError(f"--lora-modules {not_peft[0]}: --engine vllm serves peft adapter directories only "
                                f"(export a megapipe LoRA run with `megapipe export hf`, or use --engine megapipe)")
        speculative = None
        if speculative_tokens:
            speculative = {"method": engine_config.speculative_method, "num_speculative_tokens": speculative_tokens}
            if engine_config.speculative_method == "ngram":
                speculative |= {"prompt_lookup_max": engine_config.prompt_lookup_max,
                                "prompt_lookup_min": engine_config.prompt_lookup_min}
        if threads is not None:  # vLLM's CPU backend binds its OpenMP threads to these cores
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
        unused = [flag for flag, given in (("--max-queue", max_queue != MAX_QUEUE),
                                           ("--max-body-size", max_body_size != MAX_BODY_SIZE),
                                           ("--max-image-size", max_image_size != MAX_IMAGE_SIZE),
                                           ("--max-image-pixels", max_image_pixels != MAX_IMAGE_PIXELS),
                                           ("--no-engine-process", no_engine_process), ("--device", device is not None))
                  if given]
        cmd = vllm_command(python, hf_dir, host=host, port=port, api_key=api_key, served_model_name=name,
                           max_num_seqs=max_num_seqs, max_model_len=max_model_len, dtype=dtype,
                           max_num_batched_tokens=max_num_batched_tokens, prefix_caching=not no_prefix_caching,
                           tool_call_parser=tool_call_parser, gpu_memory_utilization=gpu_memory_utilization,
                           block_size=block_size, chat_template=template and template.source,
                           generation_config=generation_config, allowed_origins=origins,
                           reasoning_parser=reasoning_parser, lora_modules=loras, max_loras=max_loras,
                           max_lora_rank=max_lora_rank, speculative=speculative, num_blocks=num_blocks,
                           log_level=log_level)
        skipped = f"; {', '.join(unused)} do not apply to vLLM's server" if unused else ""
        typer.echo(f"megapipe serve: starting vLLM ({python}) on {hf_dir}{skipped}", err=True)
        code = run_vllm(cmd, env, shutdown_timeout)
        if code not in (0, -15, 143):
            raise MegapipeError(f"vLLM's server exited with status {code} (its log is above)")
        return

    import torch

    # lazy: imports fastapi and torch; megapipe --help stays fast
    from megapipe.checkpoint.load import load_model, read_model_config
    from megapipe.data.images import ImageLimits
    from megapipe.dtypes import resolve_device, resolve_dtype
    from megapipe.inference.async_engine import AsyncEngine
    from megapipe.inference.core_client import EngineCoreClient
    from megapipe.inference.engine_core import CoreSpec
    from megapipe.inference.server import ServerConfig, bind, run_server
    from megapipe.models.capabilities import require

    if threads is not None and threads < 1:
        raise MegapipeError(f"--threads = {threads} must be >= 1")
    resolve_dtype(dtype)  # a bad --dtype fails here, not in the engine core
    if chat_template is not None:
        _chat_template(chat_template, model)
    defaults = _sampling_defaults(generation_config, model)
    if defaults:  # as vLLM says it: a request that leaves these out gets the model's values, not OpenAI's
        print(f"megapipe serve: sampling defaults from the model's generation config: {defaults} "
              f"(--generation-config vllm: none)", file=sys.stderr, flush=True)
    if gpu_memory_utilization is not None and resolve_device(device).type == "cpu":  # vLLM's CPU backend too
        print("megapipe serve: --gpu-memory-utilization does not apply on a CPU: the KV cache there takes "
              "--kv-cache-memory or --num-blocks (default: what the batch needs, at most 1 GiB)", file=sys.stderr,
              flush=True)
    sock = bind(host, port)  # before loading: a busy port fails in a second, not after the model loads
    max_queue_or_none = max_queue or None
    # SIGTERM while the model loads: stop at once and take the engine core along (the server's own handlers take
    # over once it is ready, and drain)
    signal.signal(signal.SIGTERM, _stopped_while_starting)
    try:
        model_cfg = read_model_config(model)
        if model_cfg.num_labels:  # a reward model: scores on /pooling, no engine
            if threads is not None:
                torch.set_num_threads(threads)
            loaded = load_model(model, resolve_device(device), resolve_dtype(dtype))
            return _serve_reward_model(loaded, model, name, api_key, max_body_size, shutdown_timeout, sock,
                                       log_level)
        drafter = engine_config.drafter_feature
        require(model_cfg, "serve", str(model), engine=[drafter] if drafter else None)
        if loras:
            require(model_cfg, "serve", str(model), engine=["multi_lora"])
        spec = CoreSpec(str(model), engine_config, device, dtype, loras, threads)
        if no_engine_process:
            llm = spec.build()
            engine_handle, kv_line = AsyncEngine(llm, max_queue_or_none), llm.kv_cache_line()
        else:  # the model loads in the core; this process keeps the tokenizer and HTTP
            engine_handle = EngineCoreClient(spec, max_queue_or_none)
            kv_line = engine_handle.kv_cache_line
    except BaseException:
        sock.close()
        raise
    bound_host, bound_port = sock.getsockname()[:2]
    config = ServerConfig(model_name=name, model_path=str(model), api_key=api_key, max_queue=max_queue_or_none,
                          max_body_bytes=parse_size(max_body_size, "--max-body-size"),
                          shutdown_timeout=shutdown_timeout, tool_call_parser=tool_call_parser,
                          chat_template=chat_template, sampling_defaults=defaults, allowed_origins=origins,
                          reasoning_parser=reasoning_parser,
                          image_limits=ImageLimits(parse_size(max_image_size, "--max-image-size"), max_image_pixels,
                                                   ("--max-image-size", "--max-image-pixels")))

    def ready():
        where = "in this process" if no_engine_process else f"engine core pid {engine_handle.process.pid}"
        print(f"megapipe serve: ready on http://{bound_host}:{bound_port} (model {name}, max_model_len "
              f"{engine_handle.max_model_len}, {kv_line}, {where})", file=sys.stderr, flush=True)

    run_server(engine_handle, config, sock, log_level=log_level, on_ready=ready)


def _origins(items: List[str]) -> list[str]:
    """--allowed-origins as given (repeated) or as vLLM takes it (one JSON list)."""
    import json

    out = []
    for item in items:
        if item.lstrip().startswith("["):
            try:
                listed = json.loads(item)
            except ValueError as e:
                raise MegapipeError(f"--allowed-origins {item!r} is not a JSON list ({e})") from None
            if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
                raise MegapipeError(f"--allowed-origins {item!r} is not a JSON list of strings")
            out += listed
        else:
            out.append(item)
    return out


def _chat_template(choice: str, model: str):
    """The --chat-template chosen for ``model``'s tokenizer (a bad choice fails here, before anything loads)."""
    from megapipe.checkpoint.load import read_tokenizer_dir
    from megapipe.data.chat_template import load_chat_template

    tokenizer = read_tokenizer_dir(model)
    if tokenizer is None:
        raise MegapipeError(f"--chat-template needs a tokenizer, and {model} holds none")
    return load_chat_template(tokenizer, choice)


def _sampling_defaults(choice: str, model: str) -> dict:
    """--generation-config: the sampling defaults of the model's generation config (auto), of DIR's, or none."""
    from pathlib import Path

    from megapipe.checkpoint.hf.files import read_json
    from megapipe.checkpoint.load import read_generation_config
    from megapipe.inference.protocol import GENERATION_FIELDS, generation_defaults

    if choice == "vllm":
        return {}
    file = Path(choice).expanduser() / "generation_config.json"
    if choice != "auto" and not file.is_file():
        raise MegapipeError(f"--generation-config {choice!r} is not auto, vllm or a directory holding a "
                            f"generation_config.json")
    config = read_generation_config(model) if choice == "auto" else read_json(file, "generation_config.json")
    where = "the model's generation config" if choice == "auto" else str(file)
    if not isinstance(config, dict):
        raise MegapipeError(f"{where} must hold a JSON object, not {type(config).__name__}")
    for key in GENERATION_FIELDS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise MegapipeError(f"{where}: {key} = {value!r} is not a number")
    return generation_defaults(config)


def _stopped_while_starting(_signum, _frame):
    print("megapipe serve: stopped by SIGTERM while starting", file=sys.stderr, flush=True)
    raise SystemExit(0)


def _lora_modules(items: List[str]) -> dict[str, str]:
    """--lora-modules name=PATH or vLLM's JSON '{"name": ..., "path": ...}' ... -> {name: PATH}; each path must
    exist."""
    import json
    from pathlib import Path

    out = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except ValueError as e:
                raise MegapipeError(f"--lora-modules {item!r} is not JSON ({e})") from None
            name, path = spec.get("name"), spec.get("path")
            if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
                raise MegapipeError(f"--lora-modules {item!r} needs \"name\" and \"path\" strings")
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise MegapipeError(f"--lora-modules {item!r} is not name=PATH or {{\"name\": ..., \"path\": ...}}")
        if name in out:
            raise MegapipeError(f"--lora-modules names {name!r} twice")
        if not Path(path).expanduser().exists():
            raise MegapipeError(f"--lora-modules {name}={path}: {path} does not exist")
        out[name] = path
    return out


def _serve_reward_model(loaded, model: str, name: str, api_key, max_body_size: str, shutdown_timeout: float, sock,
                        log_level: str) -> None:
    # lazy: imports fastapi and torch; megapipe --help stays fast
    from megapipe.checkpoint.hf.files import parse_size
    from megapipe.inference.pooling import run_pooling_server
    from megapipe.inference.server import ServerConfig
    from megapipe.posttrain.reward_model import RewardModel

    scorer = RewardModel(loaded, model)
    config = ServerConfig(model_name=name, model_path=str(model), api_key=api_key,
                          max_body_bytes=parse_size(max_body_size, "--max-body-size"),
                          shutdown_timeout=shutdown_timeout)
    host, port = sock.getsockname()[:2]

    def ready():
        print(f"megapipe serve: ready on http://{host}:{port} (reward model {name}: POST /pooling)", file=sys.stderr,
              flush=True)

    run_pooling_server(scorer, config, sock, log_level=log_level, on_ready=ready)


def _check_api_key(api_key: Optional[str]) -> None:
    """An empty key is a mistake, never "no authentication" (click reads an empty MEGAPIPE_API_KEY as unset)."""
    import os

    if api_key is None and os.environ.get("MEGAPIPE_API_KEY") is not None:
        api_key = os.environ["MEGAPIPE_API_KEY"]
    if api_key is not None and not api_key.strip():
        source = "MEGAPIPE_API_KEY" if os.environ.get("MEGAPIPE_API_KEY") == api_key else "--api-key"
        raise MegapipeError(f"{source} is empty: give a key, or unset MEGAPIPE_API_KEY and leave out --api-key to "
                            f"serve without authentication")
