"""Load test for any OpenAI-compatible server: streamed /v1/completions under a concurrency cap or Poisson arrivals.

    # against a running server
    .venv/bin/python tools/bench_serve.py --base-url http://127.0.0.1:8000 --model NAME -n 500 --concurrency 64
    # start `megapipe serve` (or `--engine vllm`) itself on a free port, sample its memory, stop it with SIGTERM
    .venv/bin/python tools/bench_serve.py --serve ~/.cache/megapipe/smollm2 --engine megapipe -n 500 --concurrency 64
    # the same with the engine in a thread of the server instead of its own process
    .venv/bin/python tools/bench_serve.py --serve ~/.cache/megapipe/smollm2 --no-engine-process -n 500

Each request sends ``--prompt-len`` random token ids and asks for exactly ``--max-tokens`` tokens (``ignore_eos``),
streamed with ``include_usage``. Reported: request throughput, output tokens/s, time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency between chunks (ITL) and end-to-end latency at p50 / p90 /
p99, errors (any non-200, error event, wrong token count or timeout), the load average and the client's own CPU time
(it runs on the same machine), and with ``--serve`` the
server's peak RSS (its process tree) sampled every 0.5 s and the CPU time its processes spent over the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
HEADROOM = 64  # tokens past prompt + --max-tokens that a started server's max_model_len allows


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: Optional[float] = None
    e2e: float = 0.0
    itl: list = field(default_factory=list)
    tokens: int = 0


def percentile(values: list, q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_request(client: aiohttp.ClientSession, args, prompt: list[int], leave: bool = False) -> Result:
    """One streamed completion; with ``leave`` the client asks for HEADROOM more tokens (what a server that kept
    decoding it would spend) and closes the stream after its first text chunk."""
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens + (HEADROOM if leave else 0),
            "temperature": args.temperature, "top_p": args.top_p,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    res = Result()
    start = time.perf_counter()
    last = None
    try:
        async with client.post(args.base_url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for raw in r.content:
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"error event: {chunk['error'].get('message')}"
                    return res
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                        if leave:
                            res.ok, res.e2e = True, now - start
                            return res
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        if res.tokens != args.max_tokens:
            res.error = f"{res.tokens} tokens instead of {args.max_tokens}"
        else:
            res.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def client_for(args) -> aiohttp.ClientSession:
    """The load's HTTP client: aiohttp (as vLLM's own serving benchmark), whose CPU time per streamed event is about
    a third of httpx's; this client shares the server's cores, so what it spends is taken from the server."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=max(args.concurrency, 1) + 8)
    return aiohttp.ClientSession(headers=headers, connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=args.timeout))


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed (megapipe's dependencies have it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def random_prompts(rng: random.Random, args, count: int) -> list[list[int]]:
    return [[rng.randrange(100, args.vocab - 100) for _ in range(args.prompt_len)] for _ in range(count)]


async def run_load(args) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, args, args.num_requests)
    sem = asyncio.Semaphore(args.concurrency)
    async with client_for(args) as client:
        async def gated(p):
            async with sem:
                return await one_request(client, args, p)

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.ensure_future(gated(p)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def run_disconnects(args) -> dict:
    """``--disconnect N`` requests at the same concurrency, every other one closing its stream after the first
    token; once they are all done, one fresh request (its time to a full answer is what a server that keeps
    decoding abandoned requests loses), and the server's running-request gauge after it."""
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.concurrency)
    async with client_for(args) as client:
        async def gated(p, leave):
            async with sem:
                return await one_request(client, args, p, leave)

        results = await asyncio.gather(*(gated(p, i % 2 == 1) for i, p in enumerate(random_prompts(rng, args,
                                                                                                     args.disconnect))))
        fresh = await one_request(client, args, random_prompts(rng, args, 1)[0])
        async with client.get(args.base_url + "/metrics") as r:
            metrics = await r.text()
    running = [line.split()[-1] for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
    return {"disconnect_requests": len(results), "disconnect_errors": sum(not r.ok for r in results),
            "fresh_ok": fresh.ok, "fresh_error": fresh.error, "fresh_e2e_s": fresh.e2e,
            "running_after": float(running[0]) if running else None}


def _tree(pid: int) -> list[int]:
    """A process and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (MiB)."""
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def tree_cpu_s(pid: int) -> dict[int, float]:
    """CPU time (user + system, s) of a process and each descendant (the engine-core process of serve's default),
    by pid: comparable when the machine is shared, unlike the wall clock."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            out[p] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "megapipe.cli", "serve", args.serve, "--port", str(port), "--served-model-name",
           args.model, "--engine", args.engine, "--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype,
           "--max-model-len", str(args.prompt_len + args.max_tokens + HEADROOM), "--max-queue", str(args.num_requests)]
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.block_size is not None:
        cmd += ["--block-size", str(args.block_size)]
    threads = args.threads or os.cpu_count() or 1
    if args.engine == "vllm":
        cmd += ["--vllm-python", args.vllm_python, "--kv-cache-memory", "2GiB"]
    else:
        cmd += ["--threads", str(threads), "--device", args.device]
        cmd += ["--no-engine-process"] if args.no_engine_process else []
    env = dict(os.environ)
    if args.engine == "vllm":  # the same CPUs for vLLM's OpenMP threads
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url)
    return proc, url


def wait_ready(proc: subprocess.Popen, url: str, seconds: float = 600) -> None:
    """Until the server started as ``proc`` answers ``url``/health (killed, and SystemExit, if it never does)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"the server did not become ready within {seconds:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("-n", "--num-requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all "
                                                                           "at once, capped by --concurrency)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve", help="start `megapipe serve SERVE` on a free port for the run")
    ap.add_argument("--engine", default="megapipe", choices=["megapipe", "vllm"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu", help="the started megapipe server's device (cpu, cuda[:N])")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's prefill chunk (default: "
                                                                             "the engine's own)")
    ap.add_argument("--block-size", type=int, default=None, help="the server's tokens per KV block (default: its own)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of the started server (default: all)")
    ap.add_argument("--vllm-python", default=os.environ.get("MEGAPIPE_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python")))
    ap.add_argument("--no-engine-process", action="store_true",
                    help="megapipe: the engine in a thread of the server (serve --no-engine-process)")
    ap.add_argument("--disconnect", type=int, default=0, metavar="N",
                    help="after the load, N requests of which every other one disconnects after its first token, "
                         "then one fresh request (its time to a full answer is reported)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    proc, peak, dropped = None, [0.0], None
    if args.serve:
        proc, args.base_url = start_server(args)
    try:
        loop = new_event_loop()
        sampler = None
        if proc is not None:
            async def sample_memory():
                while True:
                    peak[0] = max(peak[0], tree_rss_mib(proc.pid))
                    await asyncio.sleep(0.5)
            sampler = loop.create_task(sample_memory())
        idle_rss = tree_rss_mib(proc.pid) if proc is not None else None
        cpu_before = tree_cpu_s(proc.pid) if proc is not None else {}
        load_before, client_before = os.getloadavg()[0], time.process_time()
        results, wall = loop.run_until_complete(run_load(args))
        load_after, client_cpu = os.getloadavg()[0], time.process_time() - client_before
        cpu_after = tree_cpu_s(proc.pid) if proc is not None else {}
        dropped = loop.run_until_complete(run_disconnects(args)) if args.disconnect else None
        if sampler is not None:
            sampler.cancel()
            loop.run_until_complete(asyncio.gather(sampler, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        after_rss = tree_rss_mib(proc.pid) if proc is not None else None
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = "killed after 120 s"
            print(f"server stopped with SIGTERM: exit {code}")

    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    ttft = ms([r.ttft for r in ok if r.ttft is not None])
    tpot = ms([(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1])
    itl = ms([x for r in ok for x in r.itl])
    e2e = ms([r.e2e for r in ok])
    out = {
        "requests": len(results), "errors": len(errors), "wall_s": wall,
        "request_throughput": len(ok) / wall, "output_tokens_per_s": sum(r.tokens for r in ok) / wall,
        **{f"{name}_ms_p{q}": percentile(vals, q) for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl),
                                                                    ("e2e", e2e)) for q in (50, 90, 99)},
        "mean_ttft_ms": statistics.mean(ttft) if ttft else float("nan"),
    }
    if proc is not None:
        out.update(server_rss_idle_mib=idle_rss, server_rss_peak_mib=peak[0], server_rss_after_mib=after_rss)
        cpu = {p: t - cpu_before.get(p, 0.0) for p, t in cpu_after.items()}
        out.update(server_cpu_s=sum(cpu.values()), server_front_end_cpu_s=cpu.get(proc.pid, 0.0))
    out.update(load_average_before=load_before, load_average_after=load_after, client_cpu_s=client_cpu)
    label = args.engine if args.serve else args.base_url
    print(f"\n{label}: {len(results)} requests, concurrency {args.concurrency}"
          f"{f', Poisson {args.request_rate}/s' if args.request_rate else ''}, {args.prompt_len}-token prompts, "
          f"{args.max_tokens} tokens each, temperature {args.temperature}, top-p {args.top_p}")
    print(f"  errors {len(errors)}; wall {wall:.1f} s; {out['request_throughput']:.2f} req/s; "
          f"{out['output_tokens_per_s']:.1f} output tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"  {name.upper():>4} ms  p50 {out[f'{name}_ms_p50']:9.1f}  p90 {out[f'{name}_ms_p90']:9.1f}  "
              f"p99 {out[f'{name}_ms_p99']:9.1f}")
    if proc is not None:
        print(f"  server RSS: idle {idle_rss:.0f} MiB, peak {peak[0]:.0f} MiB, after {after_rss:.0f} MiB")
        print(f"  server CPU time over the load: {out['server_cpu_s']:.1f} s (front end {out['server_front_end_cpu_s']:.1f}"
              f" s), {out['server_cpu_s'] / max(1, sum(r.tokens for r in ok)) * 1000:.2f} ms per output token")
    print(f"  load average {load_before:.1f} before, {load_after:.1f} after; this client's CPU time over the load "
          f"{client_cpu:.1f} s (it shares the machine)")
    for e in sorted(set(errors))[:5]:
        print(f"  error: {e} (x{errors.count(e)})")
    failed = bool(errors)
    if dropped is not None:
        out.update(dropped)
        print(f"  then {dropped['disconnect_requests']} requests, every other one disconnecting after its first token: "
              f"{dropped['disconnect_errors']} errors; a fresh request after them: "
              f"{'answered in %.2f s' % dropped['fresh_e2e_s'] if dropped['fresh_ok'] else dropped['fresh_error']}; "
              f"requests running on the server after it: {dropped['running_after']}")
        failed = failed or dropped["disconnect_errors"] or not dropped["fresh_ok"] or dropped["running_after"]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
