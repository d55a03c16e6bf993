"""``megapipe checkpoint inspect|verify|convert``: look into a checkpoint, check its files, consolidate it."""

from __future__ import annotations

import json
from typing import Optional

import typer

from megapipe.errors import CheckpointError, MegapipeError
from stages.common import print_table


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
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip checking the files' checksums (faster)."),
) -> None:
    """Show a checkpoint's manifest, size, parameter count, layout and lineage (after checking its checksums)."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint.convert import summary

    info = summary(ckpt, check=not no_verify)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return

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
        ("integrity", info["integrity"]),
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
    if to != "safetensors":
        raise MegapipeError(f"--to {to!r} is not a supported format (allowed: safetensors)")
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint.convert import to_safetensors
    from megapipe.dtypes import dtype_of

    target = dtype_of(dtype) if dtype else None
    path = to_safetensors(ckpt, out, dtype=target)
    typer.echo(f"wrote {path} ({_human(path.stat().st_size)})")


def verify(
    path: str = typer.Argument(..., help="A checkpoint directory, or a run directory (every checkpoint in it)."),
    as_json: bool = typer.Option(False, "--json", help="Print the reports as JSON."),
) -> None:
    """Check every file of a checkpoint against the sizes and checksums its manifest recorded, without loading it.
    Exits non-zero naming each damaged or missing file."""
    from pathlib import Path

    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint.convert import verify as verify_one
    from megapipe.checkpoint.manifest import LATEST_NAME, MANIFEST_NAME, latest_problem, list_checkpoints

    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    is_ckpt = (root / MANIFEST_NAME).exists() or (root / "model").is_dir()
    targets = [root] if is_ckpt else [p for _, p in reversed(list_checkpoints(root))]
    if not targets:
        raise CheckpointError(f"{path} is not a megapipe checkpoint: it has no {MANIFEST_NAME} and no step_* checkpoints")
    reports = [verify_one(t) for t in targets]
    pointer = None if is_ckpt else latest_problem(root)
    if pointer is not None:  # a run whose `latest` names no checkpoint is damaged too
        reports.append({"path": str(root / LATEST_NAME), "step": None, "files": 0, "checked": 0, "algorithm": None,
                        "problems": [pointer], "extra_files": []})
    if as_json:
        typer.echo(json.dumps(reports if not is_ckpt else reports[0], indent=2))
    else:
        rows = []
        for r in reports:
            state = "ok" if not r["problems"] else "DAMAGED"
            how = f"{r['checked']} of {r['files']} files by {r['algorithm']} checksum" if r["algorithm"] else (
                f"{r['files']} files by size only (no checksums recorded)")
            rows.append((Path(r["path"]).name, f"{state}: {how}"))
            rows += [("", f"  {p}") for p in r["problems"]]
            rows += [("", f"  not in the manifest (ignored): {f}") for f in r["extra_files"]]
        print_table(f"verify {path}", rows)
    bad = [r for r in reports if r["problems"]]
    if bad:
        first = bad[0]
        raise CheckpointError(
            f"{len(bad)} of {len(reports)} checkpoint(s) in {path} are damaged; first: {first['problems'][0]}"
            if not is_ckpt else f"checkpoint {path} is damaged: " + "; ".join(first["problems"][:3])
            + (f" (and {len(first['problems']) - 3} more)" if len(first["problems"]) > 3 else "")
        )
