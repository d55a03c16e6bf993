"""Check the planner's memory model against a real training step on CPU: predicted vs measured peak, relative error.

Each case runs in a fresh Python process (``--child``) so nothing of an earlier case is resident. Measurement:
glibc is told to serve every allocation over 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_, which also stops glibc from
raising that threshold dynamically), so freed tensors really leave the process and the resident set follows the
live tensors. The child warms up the kernels on a throw-away model, records its resident set, resets the kernel's
peak counter (``/proc/self/clear_refs`` = 5, Linux), builds the model and AdamW, runs two training steps
(forward, cross-entropy, backward, optimizer step, zero_grad) and reads the peak (VmHWM) back:
measured = peak - resident-before. The prediction is ``RankMemory.total`` of the single-process layout with no
fixed overhead (the CUDA context has no CPU counterpart). The activations are also checked exactly: the bytes of
the distinct non-parameter storages autograd saves in one forward (saved-tensor hooks), against
``layer_activation_bytes`` x layers + the head.

    .venv/bin/python tools/check_plan_memory.py            # the default cases (~8 min on 2 busy cores)
    .venv/bin/python tools/check_plan_memory.py --json

Measured here (2026-12-01, torch 2.13 CPU; model h256 x 4 layers, vocab 8192, seq 512; error = predicted/measured-1,
multi-rank cases: the rank that peaks highest): fp32 -0.9%, fp32 selective -1.1%, fp32 full -1.3%, fp32 with 2
accumulated micro-batches -0.9%, bf16 autocast -2.8%, FSDP dp_shard2 +6.4%, TP+SP tp2 -1.6%, PP 1F1B pp2 with 4
micro-batches -3.8% (the last stage; it was -17.4% before the planner counted what the pipeline schedule keeps per
in-flight micro-batch: the last stage's logits and the other stages' outputs; the first stage is -7.9%: send/recv
buffers and the embedding gradient's accumulation copy are not modelled), MoE (8 experts of FFN 176, top-2) -0.4%,
MoE with ep2 x dp_shard2 +6.0%. Saved activations: -0.1% dense, -0.0% MoE (the unmodelled RoPE cos/sin tables).
Hybrid Transformer-Mamba (2026-12-03, a 2-vCPU Intel Xeon at load 3-7, ``--cases hybrid`` / ``--cases Falcon``; h256
x 4, Mamba 16 heads x 32 (Falcon-H1: x 16), 2 groups x 32 state, chunk 64; the SSD scan's backward written out):
Nemotron-H kinds ``M*M-`` fp32 -3.0%, bf16 -5.2%, selective -3.5%, full -4.4%, TP+SP tp2 -3.4%; Falcon-H1's parallel
layers ``PPPP`` fp32 -2.2%, bf16 -3.7% (the scan backward's temporaries are not modelled; with autograd's scan,
2026-12-02: -0.9%, -4.8%, -1.5%, -1.7%, -1.5%, -0.7%, -3.4%). Saved activations -0.0% / +0.0% (Nemotron-H fp32 /
bf16), -0.1% / -0.1% (Falcon-H1).

    .venv/bin/python tools/check_plan_memory.py --cases hybrid   # only the cases whose name contains "hybrid"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = [
    # name, precision, recompute, micro batch, global batch
    ("fp32", "fp32", "none", 4, 4),
    ("fp32 selective", "fp32", "selective", 4, 4),
    ("fp32 full", "fp32", "full", 4, 4),
    ("fp32 accumulate x2", "fp32", "none", 4, 8),
    ("bf16", "bf16", "none", 4, 4),
    ("fp32 FSDP dp_shard2", "fp32", "none", 2, 4, {"dp_shard": 2}),
    ("fp32 TP+SP tp2", "fp32", "none", 4, 4, {"tp": 2, "dp_shard": 1}),
    ("fp32 PP 1F1B pp2, 4 micro-batches", "fp32", "none", 2, 8, {"pp": 2, "dp_shard": 1}),
    ("fp32 MoE (8 experts, top-2)", "fp32", "none", 4, 4, None, "moe"),
    ("fp32 MoE EP ep2 (dp_shard2)", "fp32", "none", 2, 4, {"dp_shard": 2, "ep": 2}, "moe"),
    ("fp32 hybrid M*M-", "fp32", "none", 4, 4, None, "hybrid"),
    ("bf16 hybrid M*M-", "bf16", "none", 4, 4, None, "hybrid"),
    ("fp32 hybrid M*M- selective", "fp32", "selective", 4, 4, None, "hybrid"),
    ("fp32 hybrid M*M- full", "fp32", "full", 4, 4, None, "hybrid"),
    ("fp32 hybrid M*M- TP+SP tp2", "fp32", "none", 4, 4, {"tp": 2, "dp_shard": 1}, "hybrid"),
    ("fp32 Falcon-H1 parallel PPPP", "fp32", "none", 4, 4, None, "falcon"),
    ("bf16 Falcon-H1 parallel PPPP", "bf16", "none", 4, 4, None, "falcon"),
]
MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4,
             tie_embeddings=False)
MOE_MODEL = dict(MODEL, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=176, moe_aux_loss_coeff=0.01)
_MAMBA = dict(mamba_state_dim=32, mamba_head_dim=32, mamba_num_groups=2, mamba_num_heads=16, mamba_chunk_size=64)
# Nemotron-H's layer kinds (Mamba-2, attention, squared-ReLU MLP, one mixer per layer) and Falcon-H1's parallel layer
HYBRID_MODEL = dict(MODEL, arch="nemotron_h", hybrid_override_pattern="M*M-", activation="relu2",
                    position_embedding="none", **_MAMBA)
FALCON_MODEL = dict(MODEL, arch="falcon_h1", mamba_gated_norm=False, **dict(_MAMBA, mamba_head_dim=16))
MODELS = {"moe": MOE_MODEL, "hybrid": HYBRID_MODEL, "falcon": FALCON_MODEL}
SEQ = 512


def build_cfg(precision: str, recompute: str, micro: int, global_: int, model: dict | None = None, seq: int = SEQ,
              layout: dict | None = None):
    from megapipe.config import load_config

    over = {f"model.{k}": v for k, v in (model or MODEL).items()}
    over.update({f"parallel.{k}": v for k, v in (layout or {}).items()})
    over.update({"train.precision": precision, "train.recompute": recompute, "train.micro_batch_size": micro,
                 "train.global_batch_size": global_, "data.seq_length": seq})
    return load_config(None, over)


def _cfg_of(case: dict):
    return build_cfg(case["precision"], case["recompute"], case["micro"], case["global"], case.get("model"),
                     case.get("seq", SEQ), case.get("layout"))


def _world(case: dict) -> int:
    n = 1
    for k, v in (case.get("layout") or {}).items():
        if k != "ep":  # ep borrows from dp_shard
            n *= max(v, 1)
    return n


def predict(cfg, world: int = 1) -> dict:
    from megapipe.parallel.dims import ParallelDims
    from megapipe.parallel.plan import block_activation_bytes, head_activation_bytes, param_counts, rank_memory

    dims = ParallelDims.from_config(cfg.parallel, world, cfg.train, cfg.model, cfg.data.seq_length)
    rank = max(rank_memory(cfg, dims, cfg.data.seq_length, overhead=0.0), key=lambda r: r.total(cfg.train.recompute))
    tokens = cfg.train.micro_batch_size * cfg.data.seq_length
    kept, _ = head_activation_bytes(cfg.model, cfg.train.precision)
    no_loss = kept - 4 * cfg.model.vocab_size  # the hooks see the model's forward only, not the loss
    blocks = sum(block_activation_bytes(cfg.model, lc.kind, cfg.train.precision, "none")
                 for lc in param_counts(cfg.model).layers)
    saved = (blocks + no_loss) * tokens
    # under autocast the bf16 weight copies are saved tensors too
    return {"peak": rank.total(cfg.train.recompute), "saved_activations": saved + rank.compute_copies}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _saved_bytes(model, inputs: tuple, ctx) -> int:
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and t.dtype != torch.int64:
            seen[s.data_ptr()] = s  # held, so that no later tensor reuses the address of one freed meanwhile
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx():
        model(*inputs)
    return sum(s.nbytes() for s in seen.values())


def block_saved_bytes_per_token(block, hidden: int, seq: int, ctx, rope=None) -> float:
    """What one block's forward saves for backward per token of its input, parameters and anything that does not
    grow with the batch (cast or concatenated weights) left out: the saved bytes at batch 2 minus batch 1, / seq.
    ``rope(batch) -> rope tables`` for blocks with attention."""
    import torch

    sizes = []
    for batch in (1, 2):
        x = torch.randn(batch, seq, hidden, requires_grad=True)
        sizes.append(_saved_bytes(block, (x, None if rope is None else rope(batch)), ctx))
    return (sizes[1] - sizes[0]) / seq


def selective_kept_bytes_per_token(block, hidden: int, seq: int, ctx, rope=None) -> float:
    """What selective recompute keeps of one block per token: its fp32 input and the outputs of the ops the
    recompute policy saves (megapipe.parallel.recompute: matmuls, attention kernels), recorded as the forward runs
    them (batch 2 minus batch 1, / seq)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megapipe.parallel.recompute import _save_ops

    save = _save_ops()

    class Record(TorchDispatchMode):
        kept = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in save:
                self.kept += sum(o.numel() * o.element_size() for o in (out if isinstance(out, (tuple, list))
                                                                       else (out,)) if isinstance(o, torch.Tensor))
            return out

    sizes = []
    for batch in (1, 2):
        x = torch.randn(batch, seq, hidden, requires_grad=True)
        with ctx(), Record() as record:
            block(x, None if rope is None else rope(batch))
        sizes.append(record.kept)
    return (sizes[1] - sizes[0]) / seq + 4 * hidden


def child(case: dict) -> dict:
    import gc

    import torch

    from megapipe.models import build_model
    from megapipe.parallel.parallelize import parallelize_model
    from megapipe.parallel.step import train_step
    from megapipe.training.optim import build_optimizer
    from megapipe.training.precision import autocast

    torch.set_num_threads(1)
    cfg = _cfg_of(case)
    world = _world(case)
    t = cfg.train
    dims = None
    if world > 1:
        from megapipe.parallel.parallelize import setup_parallel

        _, dims = setup_parallel(cfg, "cpu")
    else:
        from megapipe.parallel.dims import ParallelDims

        dims = ParallelDims.from_config(cfg.parallel, 1, t, cfg.model, cfg.data.seq_length)
    n_micro = dims.num_microbatches(t)
    gen = torch.Generator().manual_seed(dims.dp_rank)
    batches = [torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, cfg.data.seq_length + 1), generator=gen)
               for _ in range(n_micro)]

    def ctx():
        return autocast(t.precision, "cpu")

    def build(model_cfg):
        model = parallelize_model(build_model(model_cfg, seed=0), dims, cfg)
        return model, build_optimizer(model, cfg.optim, 1e-3)

    def steps(model, opt, mbs, n_steps):
        for _ in range(n_steps):
            train_step(model, [{"tokens": b[:, :-1], "labels": b[:, 1:]} for b in mbs], dims, context=ctx)
            opt.step()
            opt.zero_grad(set_to_none=True)

    # warm-up: load kernels, allocator, autograd and process-group machinery on a throw-away one-layer model
    warm, warm_opt = build(dataclasses_replace(cfg.model, num_layers=1))
    steps(warm, warm_opt, [b[:, : 16 * dims.tp + 1] for b in batches], 1)
    del warm, warm_opt
    gc.collect()
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model, opt = build(cfg.model)
    steps(model, opt, batches, 2)
    peak = _rss("VmHWM") - before
    out = {"peak": peak}
    if t.recompute == "none" and world == 1:
        out["saved_activations"] = _saved_bytes(model, (batches[0][:, :-1],), ctx)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(case: dict) -> dict:
    """Run the case in fresh processes (one per rank); the peak of the rank that peaks highest."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    world = _world(case)
    env.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    results = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"measurement child failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {**max(results, key=lambda r: r["peak"]), "rank_peaks": [r["peak"] for r in results]}


def compare(case: dict) -> dict:
    cfg = _cfg_of(case)
    pred, meas = predict(cfg, _world(case)), measure(case)
    row = {"case": case.get("name", ""), "predicted_peak": pred["peak"], "measured_peak": meas["peak"],
           "peak_error": pred["peak"] / meas["peak"] - 1}
    if "saved_activations" in meas:
        row.update(predicted_saved=pred["saved_activations"], measured_saved=meas["saved_activations"],
                   saved_error=pred["saved_activations"] / meas["saved_activations"] - 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", help="only the cases whose name contains this (e.g. hybrid)")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    rows = [compare(dict(name=c[0], precision=c[1], recompute=c[2], micro=c[3], layout=c[5] if len(c) > 5 else None,
                         model=MODELS[c[6]] if len(c) > 6 else None, **{"global": c[4]}))
            for c in CASES if args.cases is None or args.cases in c[0]]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"planner vs measured peak memory (CPU, model {MODEL}, seq {SEQ})", title_justify="left")
    for col in ("case", "predicted MB", "measured MB", "error", "saved acts pred MB", "saved acts meas MB",
                "error"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        saved = ([f"{r['predicted_saved'] / 1e6:.1f}", f"{r['measured_saved'] / 1e6:.1f}", f"{r['saved_error']:+.1%}"]
                 if "saved_error" in r else ["", "", ""])
        table.add_row(r["case"], f"{r['predicted_peak'] / 1e6:.1f}", f"{r['measured_peak'] / 1e6:.1f}",
                      f"{r['peak_error']:+.1%}", *saved)
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
