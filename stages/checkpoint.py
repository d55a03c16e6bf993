"""``megapipe checkpoint inspect|convert``: look into a checkpoint, consolidate it to safetensors."""

from __future__ import annotations

import json
from typing import Optional

import typer

ORDER = 80

DTYPES = ("fp32", "bf16", "fp16")


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.0f} {prefix}{unit}" if prefix == "" else f"{n:.1f} {prefix}{unit}"
        n /= 1024
    return str(n)


def _count(n: int) -> str:
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{suffix} ({n:,})"
    return f"{n:,}"


def _quantization(q) -> str:
    """One line for a quantized checkpoint (its full ModelOpt state is in the manifest and in --json)."""
    if not q:
        return "-"
    if not isinstance(q, dict) or "format" not in q:
        return json.dumps(q)
    kv = f" + kv {q['kv_cache']}" if q.get("kv_cache") else ""
    calib = q.get("calibration") or {}
    return f"{q['format']}{kv} ({q.get('tool', '?')}; {calib.get('samples', '?')} x {calib.get('seq_length', '?')} tokens)"


def inspect(
    ckpt: str = typer.Argument(..., help="A checkpoint directory, or a run directory (its newest complete checkpoint)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Show a checkpoint's manifest, size, parameter count, layout and lineage."""
    from megapipe.checkpoint.convert import summary

    info = summary(ckpt)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    from stages.common import print_table

    model = info["model"] or {}
    rows = [
        ("step", str(info["step"])),
        ("stage", str(info["stage"])),
        ("created", str(info["created"])),
        ("tokens seen", f"{info['tokens_seen'] or 0:,}"),
        ("parameters", _count(info["parameters"])),
        ("tensors", str(info["tensors"])),
        ("dtypes", ", ".join(f"{k}: {_count(v)}" for k, v in info["parameters_by_dtype"].items())),
        (
            "model",
            ", ".join(f"{k}={model[k]}" for k in ("arch", "num_layers", "hidden_size", "num_heads", "vocab_size") if k in model)
            or "-",
        ),
        ("layout (saved)", json.dumps(info["layout"])),
        ("optimizer state", "yes" if info["optimizer_state"] else "no (weights only)"),
        ("RNG states", f"{info['rng_ranks']} rank(s)"),
        ("tokenizer", str(info["tokenizer"] or "-")),
        ("quantization", _quantization(info["quantization"])),
        ("size on disk", _human(info["size_bytes"])),
        (
            "lineage",
            " <- ".join(f"{c['stage'] or '?'}@{c['step']} ({c['path']})" for c in info["lineage"]),
        ),
    ]
    print_table(f"checkpoint {info['path']}", rows)


def convert(
    ckpt: str = typer.Argument(..., help="A checkpoint directory, or a run directory (its newest complete checkpoint)."),
    out: str = typer.Argument(..., help="Output directory (must not exist, or be empty)."),
    to: str = typer.Option(..., "--to", help="Output format: safetensors."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast floating-point weights: fp32, bf16 or fp16."),
) -> None:
    """Consolidate a (sharded) checkpoint into full weights: OUT/model.safetensors + config.json."""
    from megapipe.errors import MegapipeError

    if to != "safetensors":
        raise MegapipeError(f"--to {to!r} is not a supported format (allowed: safetensors)")
    if dtype is not None and dtype not in DTYPES:
        raise MegapipeError(f"--dtype {dtype!r} is not supported (allowed: {', '.join(DTYPES)})")
    import torch

    from megapipe.checkpoint.convert import to_safetensors

    target = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype) if dtype else None
    path = to_safetensors(ckpt, out, dtype=target)
    typer.echo(f"wrote {path} ({_human(path.stat().st_size)})")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Inspect and convert megapipe checkpoints.", no_args_is_help=True)
    group.command("inspect")(inspect)
    group.command("convert")(convert)
    app.add_typer(group, name="checkpoint")
