"""``megapipe plan``: parameters, memory per rank, step FLOPs/time and the best layouts for a GPU count."""

from __future__ import annotations

from typing import List, Optional

import typer

from stages.common import CONFIG_OPTION, SET_OPTION, build_config


def plan(
    config: Optional[str] = CONFIG_OPTION,
    gpus: int = typer.Option(..., "--gpus", help="Number of GPUs (world size)."),
    gpu_type: str = typer.Option("h100", "--gpu-type", help="h100, h200 or a100 (memory and peak bf16 FLOP/s)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model preset (llama3-8b, ...); --set model.*=."),
    seq_length: Optional[int] = typer.Option(None, "--seq-length"),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size"),
    global_batch_size: Optional[int] = typer.Option(None, "--global-batch-size"),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32, bf16 or fp16."),
    recompute: Optional[str] = typer.Option(None, "--recompute", help="none, selective or full."),
    tp: Optional[int] = typer.Option(None, "--tp", "--tensor-model-parallel-size"),
    pp: Optional[int] = typer.Option(None, "--pp", "--pipeline-model-parallel-size"),
    cp: Optional[int] = typer.Option(None, "--cp", "--context-parallel-size"),
    ep: Optional[int] = typer.Option(None, "--ep", "--expert-model-parallel-size", help="Expert parallel size (MoE)."),
    dp_shard: Optional[int] = typer.Option(None, "--dp-shard", help="FSDP degree (-1: the rest)."),
    dp_replicate: Optional[int] = typer.Option(None, "--dp-replicate", help="HSDP replicas."),
    mfu: float = typer.Option(0.40, "--mfu", help="Assumed model FLOPs utilisation for the step time."),
    top: int = typer.Option(5, "--top", help="How many layouts to list."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    sets: Optional[List[str]] = SET_OPTION,
) -> None:
    """Estimate memory per rank and step time of a config on N GPUs, and rank the layouts that fit."""
    flags = {
        "model.preset": model, "data.seq_length": seq_length, "train.micro_batch_size": micro_batch_size,
        "train.global_batch_size": global_batch_size, "train.precision": precision, "train.recompute": recompute,
        "parallel.tp": tp, "parallel.pp": pp, "parallel.cp": cp, "parallel.ep": ep, "parallel.dp_shard": dp_shard,
        "parallel.dp_replicate": dp_replicate,
    }
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.parallel.plan import plan as make_plan

    cfg = build_config(config, flags, sets)
    result = make_plan(cfg, gpus, gpu_type, mfu, top)
    if as_json:
        import json

        typer.echo(json.dumps(result, indent=1))
    else:
        show(result)


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _flop(x: float) -> str:
    for scale, unit in ((1e18, "EFLOP"), (1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP")):
        if x >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x / 1e6:,.2f} MFLOP"


def _secs(x: float) -> str:
    return f"{x:,.2f} s" if x >= 1 else f"{x * 1e3:,.2f} ms"


def _layout(d: dict) -> str:
    parts = [f"{n}{d[n]}" for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp") if d[n] > 1]
    text = " x ".join(parts) or "single"
    return text + (f" (ep{d['ep']} within dp_shard)" if d.get("ep", 1) > 1 else "")


def show(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    p, g = r["params"], r["gpu"]
    layers = ", ".join(f"{n} {kind} layers x {p['per_layer'][kind] / 1e6:,.2f} M"
                       for kind, n in p["layers_by_kind"].items())
    moe = f", {p['active'] / 1e9:.3f} B active per token" if p["experts"] else ""
    con.print(
        f"[bold]{g['count']} x {g['name']}[/] ({_gb(g['memory_bytes'])} GB, {g['peak_flops'] / 1e12:.0f} TFLOP/s bf16)"
        f"   parameters {p['total'] / 1e9:.3f} B{moe} (embedding {p['embedding'] / 1e6:,.1f} M, "
        f"{layers}, head {p['head'] / 1e6:,.1f} M{', tied' if p['tied'] else ''})"
        + (f" + MTP {p['mtp'] / 1e6:,.1f} M ({p['total_with_mtp'] / 1e9:.3f} B with MTP)" if p["mtp"] else "")
    )
    vision = r.get("vision")
    if vision:
        con.print(f"vision tower: {vision['params'] / 1e6:,.1f} M parameters ({vision['params_share']:.1%}), "
                  f"{_gb(vision['memory_bytes'])} GB of the first rank's weights, gradients and optimizer state "
                  f"({vision['memory_share']:.1%}), {_flop(vision['flops_per_image'])} per "
                  f"{vision['image'][0]}x{vision['image'][1]} image ({vision['image_tokens']} tokens; "
                  f"{vision['flops_share']:.1%} of a sample's FLOPs with one image)")
    kv = r["kv_cache"]
    ratio = kv["gqa_equivalent_bytes_per_token"] / kv["bytes_per_token"]
    con.print(f"KV cache per token (bf16): {kv['bytes_per_token'] / 1024:,.1f} KiB"
              + (f" (per-head keys and values, the GQA equivalent: {kv['gqa_equivalent_bytes_per_token'] / 1024:,.1f}"
                 f" KiB, {ratio:.1f}x)" if ratio != 1 else ""))
    lay = r["layout"]
    t = Table(title=f"memory per rank, GB: layout {_layout(lay)} ({lay['dp_mode']}, "
                    f"{lay['microbatches']} micro-batches/step, recompute {r['recompute']})", title_justify="left")
    ranks = r["ranks"]
    t.add_column("")
    for k in ranks:
        t.add_column(f"pp rank {k['pp_rank']}" if len(ranks) > 1 else "every rank", justify="right")
    t.add_row("layers", *(str(k["layers"]) for k in ranks))
    t.add_row("parameters (before FSDP)", *(f"{k['params'] / 1e6:,.1f} M" for k in ranks))
    for key, label in (("weights", "weights fp32"), ("grads", "gradients fp32"), ("optimizer", "optimizer state"),
                       ("compute_copies", "compute copies")):
        t.add_row(label, *(_gb(k[key]) for k in ranks))
    if p["experts"]:
        t.add_row("  of which routed experts", *(_gb(k["expert_bytes"]) for k in ranks))
        t.add_row("MoE all-to-all per step", *(_gb(k["all_to_all_bytes"]) for k in ranks))
    for mode in ("none", "selective", "full"):
        mark = " *" if mode == r["recompute"] else ""
        t.add_row(f"activations, recompute {mode}{mark}", *(_gb(k["activations"][mode]) for k in ranks))
    t.add_row("fixed overhead", *(_gb(k["overhead"]) for k in ranks))
    for mode in ("none", "selective", "full"):
        style = "bold" if mode == r["recompute"] else "dim"
        t.add_row(f"[{style}]total, recompute {mode}[/]",
                  *(f"[{style}]{_gb(k['total'][mode])}"
                    f"{'' if k['total'][mode] <= g['memory_bytes'] else ' [red](does not fit)[/]'}[/]"
                    for k in ranks))
    con.print(t)
    fl = r["flops"]
    eff = r["efficiency"]
    con.print(
        f"step: {fl['none']['tokens']:,} tokens, {_flop(fl['none']['model_flops'])} model "
        f"({_flop(fl['none']['flops_per_token'])}/token; with full recompute "
        f"{_flop(fl['full']['hardware_flops'])})   at {r['mfu_assumed']:.0%} MFU x layout efficiency "
        f"{eff['total']:.2f} (pp bubble {1 - eff['pp_bubble']:.1%}): "
        f"[bold]{_secs(r['step_time_s'])}/step, {r['tokens_per_s']:,.0f} tokens/s[/]"
    )
    if "all_to_all_s" in eff:
        con.print(f"MoE: token all-to-all {_secs(eff['all_to_all_s'])}/step (on the critical path), routed experts' "
                  f"FSDP traffic {_secs(eff['expert_fsdp_s'])}/step (overlapped with compute)")
    best = Table(title=f"best layouts for {g['count']} GPUs ({r['layouts_fit']} of {r['layouts_valid']} valid layouts "
                       f"fit in memory, recompute {r['recompute']})", title_justify="left")
    dims = ("dp_replicate", "dp_shard", "cp", "tp", "pp") + (("ep",) if p["experts"] else ())
    for col in ("#", *dims, "peak GB", "pp bubble", "efficiency", "step", "tokens/s"):
        best.add_column(col, justify="right")
    for i, b in enumerate(r["best_layouts"], 1):
        best.add_row(str(i), *(str(b[n]) for n in dims),
                     _gb(b["memory_bytes"]), f"{b['pp_bubble']:.1%}", f"{b['efficiency']:.2f}",
                     _secs(b["step_time_s"]), f"{b['tokens_per_s']:,.0f}")
    con.print(best)
    if not r["best_layouts"]:
        con.print("[yellow]no layout fits: try --recompute full, a smaller --micro-batch-size or more GPUs[/]")
