"""Serving with one image per request against text-only requests of the same prompt length, through `megapipe serve`:

    PYTHONPATH=. .venv/bin/python tools/bench_serve_vision.py [-n 16] [--concurrency 4] [--size 224] [--rounds 2]

A random Qwen2.5-VL of ``qwen2.5-vl-tiny``'s sizes (decoder 4 x 256, tower 4 x 128; tools/shapes_vl.py's tokenizer
and chat template) is imported and served on a free port (one torch thread). Each image request is a chat completion
of one ``--size`` x ``--size`` PNG of megapipe.data.shapes as a data: URL (each image different, so the prefix cache
shares nothing) and a question; each text-only request has random words instead of the image, as many tokens as
the image request's prompt (checked against the server's usage). Every request asks for ``--max-tokens`` tokens
(ignore_eos). The two kinds run in alternating rounds (text first: the baseline), the same requests each round.
Printed per kind: output tokens/s (wall), and the server's CPU seconds (its process tree, from /proc) per 1000 output
tokens, both as ratios to text-only; the load average before and after (the machine is shared: read the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import percentile, wait_ready  # noqa: E402
from shapes_vl import make_model  # noqa: E402

# qwen2.5-vl-tiny (megapipe/presets.py) as Hugging Face config fields
TEXT = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}}
VISION = {"depth": 4, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "out_hidden_size": 256,
          "fullatt_block_indexes": [1, 3], "window_size": 56}
WORDS = ["red", "green", "blue", "yellow", "circle", "square", "triangle", "picture", "what", "is", "in", "the"]


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (live ones), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(d.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
            except (OSError, IndexError, ValueError):
                continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(c for c, (ppid, _) in stats.items() if ppid == p)
        total += stats.get(p, (0, 0))[1]
    return total / tick


def serve(ckpt: Path, max_len: int, seqs: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "megapipe.cli", "serve", str(ckpt), "--port", str(port), "--threads", "1",
           "--max-model-len", str(max_len), "--max-num-seqs", str(seqs), "--served-model-name", "vl"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url)
    return proc, url


def chat(url: str, content, max_tokens: int) -> dict:
    body = {"model": "vl", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    if r.status_code != 200:
        raise SystemExit(f"HTTP {r.status_code}: {r.text[:300]}")
    return {"e2e": time.perf_counter() - started, **r.json()["usage"]}


def text_of_length(url: str, tokens: int, rng: random.Random) -> str:
    """Random words whose chat prompt is exactly ``tokens`` long (asked of the server with max_tokens 1)."""
    words = []
    while True:
        text = " ".join(words)
        have = chat(url, [{"type": "text", "text": text}], 1)["prompt_tokens"]
        if have == tokens:
            return text
        if have > tokens:
            words = words[:-2]
        else:
            words += [rng.choice(WORDS) for _ in range(max(1, (tokens - have) // 2))]


def run_round(url: str, pid: int, contents: list, args) -> dict:
    cpu0, started = tree_cpu_s(pid), time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        done = list(pool.map(lambda c: chat(url, c, args.max_tokens), contents))
    wall, cpu = time.perf_counter() - started, tree_cpu_s(pid) - cpu0
    out_tokens = sum(d["completion_tokens"] for d in done)
    if out_tokens != args.max_tokens * len(contents):
        raise SystemExit(f"{out_tokens} output tokens instead of {args.max_tokens * len(contents)}")
    return {"wall_s": wall, "cpu_s": cpu, "tokens_per_s": out_tokens / wall, "cpu_s_per_1k": 1000 * cpu / out_tokens,
            "prompt_tokens": sorted({d["prompt_tokens"] for d in done}),
            "e2e_p50_ms": 1000 * percentile([d["e2e"] for d in done], 50)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--num-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--size", type=int, default=224, help="image side in pixels (224: 64 image tokens)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    from megapipe.cli import main as cli
    from megapipe.data.shapes import QUESTION, png_data_url, shape_set

    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench_serve_vision_"))
    make_model(work / "hf", TEXT, VISION)
    assert cli(["import", "hf", str(work / "hf"), str(work / "ckpt"), "--quiet"]) == 0
    images = [png_data_url(im.resize((args.size, args.size))) for im, _, _ in shape_set(args.num_requests, args.seed)]
    with_image = [[{"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": QUESTION}] for u in images]
    proc, url = serve(work / "ckpt", 2048, args.concurrency)
    try:
        prompt_len = chat(url, with_image[0], 1)["prompt_tokens"]
        rng = random.Random(args.seed)
        text_only = [[{"type": "text", "text": text_of_length(url, prompt_len, rng)}] for _ in images]
        chat(url, text_only[0], args.max_tokens)  # warm-up, both kinds
        chat(url, with_image[-1], args.max_tokens)
        rounds = {"text": [], "image": []}
        for _ in range(args.rounds):
            for kind, contents in (("text", text_only), ("image", with_image)):
                rounds[kind].append(run_round(url, proc.pid, contents, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    mean = {k: {f: sum(r[f] for r in rs) / len(rs) for f in ("tokens_per_s", "cpu_s_per_1k", "e2e_p50_ms")}
            for k, rs in rounds.items()}
    out = {"requests": args.num_requests, "concurrency": args.concurrency, "prompt_tokens": prompt_len,
           "image": f"{args.size}x{args.size}", "max_tokens": args.max_tokens, "rounds": rounds, "mean": mean,
           "tokens_per_s_ratio": mean["image"]["tokens_per_s"] / mean["text"]["tokens_per_s"],
           "cpu_per_token_ratio": mean["image"]["cpu_s_per_1k"] / mean["text"]["cpu_s_per_1k"],
           "load_before": load_before, "load_after": os.getloadavg()}
    print(f"{args.num_requests} chat requests x {args.rounds} rounds, concurrency {args.concurrency}, prompts of "
          f"{prompt_len} tokens (image requests: one {args.size}x{args.size} image), {args.max_tokens} tokens each, "
          f"server on 1 thread")
    for kind in ("text", "image"):
        m, each = mean[kind], ", ".join(f"{r['tokens_per_s']:.1f}" for r in rounds[kind])
        print(f"  {kind + (' (baseline)' if kind == 'text' else ''):<16} {m['tokens_per_s']:8.1f} output tok/s  "
              f"{m['cpu_s_per_1k']:6.2f} server CPU s / 1k tokens  e2e p50 {m['e2e_p50_ms']:7.0f} ms  "
              f"(rounds: {each} tok/s)")
    print(f"  image / text: {out['tokens_per_s_ratio']:.2f}x tokens/s, {out['cpu_per_token_ratio']:.2f}x server CPU "
          f"per token; load average {load_before[0]:.1f} before, {out['load_after'][0]:.1f} after")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
