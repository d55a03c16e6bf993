"""Speculative decoding with the model's own MTP modules: acceptance rate and decode speed at batch 1, one run.

A small model (``--model``: the ``deepseek-v3-tiny`` preset, multi-latent attention + MoE, by default; ``tiny`` for
Llama) with MTP modules (``--mtp-num-layers``) is pretrained briefly on the Shakespeare corpus (the data
of tools/bench_distill.py: ``megapipe data fetch shakespeare``, a byte-level BPE, cached under --work), then the
engine decodes the same prompts (openings of the corpus subset's last long paragraphs) greedily at batch 1 without drafts and with
``--speculative-tokens`` K for each K given, taking turns per repetition. Prints the MTP acceptance rate per draft
position, decode tokens/s (new tokens / wall time of the whole generation, prompt included) and the ratio to no
drafts; the greedy texts must be identical.

    .venv/bin/python tools/bench_spec.py                      # a few minutes on 2 CPU cores
    .venv/bin/python tools/bench_spec.py --steps 600 --k 1,2,3
    .venv/bin/python tools/bench_spec.py --num-layers 12   # the draft a smaller share of a decode step

``--method ngram``: prompt-lookup drafts (``--speculative-method ngram``) on a repetitive-document workload instead:
the real SmolLM2-135M (``MEGAPIPE_SMOLLM2_DIR``, default ~/.cache/megapipe/smollm2, tools/prepare_smollm2.py) is
given Shakespeare passages (tests/fixtures/shakespeare_excerpt.jsonl) and asked to write each out again; the same
timing, identity check and ratio, for each K of ``--k``. Without SmolLM2 the model pretrained above serves (the
default ``--model`` for this mode is then ``tiny``).

    .venv/bin/python tools/bench_spec.py --method ngram --k 3,5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]


def prompts_from(subset: Path, tok, count: int, words: int) -> list[list[int]]:
    """The first ``words`` words of the subset's last ``count`` long paragraphs."""
    import json

    texts = [json.loads(line)["text"] for line in subset.open()]
    long = [t for t in texts if len(t.split()) > 3 * words][-count:]
    return [list(tok.encode(" ".join(t.split()[:words]))) for t in long]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(Path.home() / ".cache/megapipe/bench_spec"))
    ap.add_argument("--max-docs", type=int, default=30000)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--model", default="deepseek-v3-tiny", help="a preset")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--num-layers", type=int, default=None,
                    help="main model layers (default: the preset's); drafting costs about one layer of them")
    ap.add_argument("--mtp-num-layers", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", default="1,2", help="--speculative-tokens values to measure, comma-separated")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fresh", action="store_true", help="pretrain again")
    ap.add_argument("--method", default="mtp", choices=["mtp", "ngram"], help="the drafter")
    ap.add_argument("--lookup", default="4,2", help="ngram: --prompt-lookup-max,--prompt-lookup-min")
    args = ap.parse_args()
    if args.method == "ngram":
        smollm2 = Path(os.environ.get("MEGAPIPE_SMOLLM2_DIR", "~/.cache/megapipe/smollm2")).expanduser()
        if (smollm2 / "config.json").is_file():
            return ngram_bench(args, smollm2, "SmolLM2-135M")
        if args.model == "deepseek-v3-tiny":
            args.model, args.mtp_num_layers = "tiny", 0
    import shutil

    import torch
    from bench_distill import prepare_data

    from megapipe.checkpoint import list_checkpoints
    from megapipe.checkpoint.load import load_model
    from megapipe.cli import main as megapipe
    from megapipe.data.tokenizer import load_tokenizer
    from megapipe.inference import LLMEngine, SamplingParams
    from megapipe.inference.engine import EngineConfig

    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    prefix, tok_dir = prepare_data(work, args.max_docs, args.vocab)
    layers = f"_L{args.num_layers}" if args.num_layers else ""
    run = work / f"run_{args.model}{layers}_mtp{args.mtp_num_layers}_{args.steps}"
    if args.fresh:
        shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    if not list_checkpoints(run):
        mtp = ["--mtp-num-layers", str(args.mtp_num_layers)] if args.mtp_num_layers else []
        assert megapipe(["pretrain", "--model", args.model, *mtp,
                         "--data-path", prefix, "--tokenizer", str(tok_dir), "--seq-length", str(args.seq),
                         "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch),
                         "--train-iters", str(args.steps), "--lr", "2e-3", "--lr-warmup-iters", "20",
                         "--eval-iters", "0", "--log-interval", "50", "--quiet", "--save", str(run)]
                        + (["--set", f"model.num_layers={args.num_layers}"] if args.num_layers else [])) == 0
    train_s = time.perf_counter() - t0

    if args.method == "ngram":
        return ngram_bench(args, list_checkpoints(run)[-1][1], f"{args.model} ({args.steps} pretraining steps)")
    torch.set_num_threads(args.threads)
    loaded = load_model(list_checkpoints(run)[-1][1], torch.device("cpu"))
    tok = load_tokenizer(tok_dir)
    prompts = prompts_from(work / "subset.jsonl", tok, args.prompts, 12)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    ks = [0] + [int(k) for k in args.k.split(",")]
    engines = {k: LLMEngine(loaded.model, tok, EngineConfig(max_num_seqs=1, speculative_tokens=k), loaded.eos_ids)
               for k in ks}

    times, texts = timed_turns(engines, prompts, params, args.reps)
    tokens = len(prompts) * args.new_tokens
    speed = {k: tokens / statistics.median(times[k]) for k in ks}
    print(f"{args.model} ({loaded.model.cfg.num_layers} layers) + {args.mtp_num_layers} MTP module(s), {args.steps} pretraining steps ({train_s:.0f} s); "
          f"{len(prompts)} prompts x {args.new_tokens} new tokens, batch 1, {args.threads} thread(s)")
    print(f"  no drafts: {speed[0]:.1f} tokens/s")
    for k in ks[1:]:
        assert texts[k] == texts[0], f"--speculative-tokens {k} changed the greedy output"
        s = engines[k].stats()
        per_pos = ", ".join(f"{r:.2f}" for r in s["spec_decode_acceptance_rate_per_pos"])
        print(f"  --speculative-tokens {k}: {speed[k]:.1f} tokens/s = {speed[k] / speed[0]:.2f}x; acceptance rate "
              f"{s['spec_decode_acceptance_rate']:.2f} (per draft position: {per_pos}); greedy text identical")
    return 0


def repeat_prompts(tok, count: int) -> list[list[int]]:
    """Shakespeare passages of a few hundred tokens, each followed by the request to write it out again."""
    import json

    texts = [json.loads(line)["text"] for line in (ROOT / "tests/fixtures/shakespeare_excerpt.jsonl").open()]
    prompts, doc = [], []
    for t in texts:
        doc.append(t)
        if len(" ".join(doc).split()) > 150:
            text = "\n\n".join(doc)
            prompts.append(list(tok.encode(f"{text}\n\nThe same passage again, word for word:\n\n{doc[0][:40]}")))
            doc = []
        if len(prompts) == count:
            break
    return prompts


def ngram_bench(args, path, label: str) -> int:
    """Batch-1 greedy decode of the repeat-the-passage prompts without drafts and with n-gram drafts of each K."""
    import torch

    from megapipe.checkpoint.load import load_model
    from megapipe.inference import LLMEngine, SamplingParams
    from megapipe.inference.engine import EngineConfig

    torch.set_num_threads(args.threads)
    loaded = load_model(path, torch.device("cpu"))
    prompts = repeat_prompts(loaded.tokenizer, args.prompts)
    longest, shortest = (int(x) for x in args.lookup.split(","))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    ks = [0] + [int(k) for k in args.k.split(",")]
    engines = {k: LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(
        max_num_seqs=1, speculative_tokens=k, speculative_method="ngram", prompt_lookup_max=longest,
        prompt_lookup_min=shortest, max_model_len=2048), loaded.eos_ids) for k in ks}
    times, texts = timed_turns(engines, prompts, params, args.reps)
    tokens = len(prompts) * args.new_tokens
    speed = {k: tokens / statistics.median(times[k]) for k in ks}
    print(f"{label}, n-gram drafts (prompt lookup {longest}..{shortest}): {len(prompts)} repeat-the-passage prompts "
          f"({sum(map(len, prompts)) // len(prompts)} tokens on average) x {args.new_tokens} new tokens, batch 1, "
          f"{args.threads} thread(s), median of {args.reps}")
    print(f"  no drafts: {speed[0]:.1f} tokens/s")
    for k in ks[1:]:
        assert texts[k] == texts[0], f"--speculative-tokens {k} changed the greedy output"
        s = engines[k].stats()
        print(f"  --speculative-method ngram --speculative-tokens {k}: {speed[k]:.1f} tokens/s = "
              f"{speed[k] / speed[0]:.2f}x; acceptance rate {s['spec_decode_acceptance_rate']:.2f}, "
              f"{engines[k].num_generation_tokens / max(1, engines[k].num_steps):.2f} tokens per step; greedy text "
              f"identical")
    return 0


def timed_turns(engines: dict, prompts, params, reps: int) -> tuple[dict, dict]:
    """Seconds per repetition of each engine generating every prompt one at a time (batch 1), taking turns after a
    warm-up; and each engine's tokens."""
    def decode(e) -> tuple[float, list[list[int]]]:
        started = time.perf_counter()
        out = [e.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        return time.perf_counter() - started, out

    for e in engines.values():  # warm-up (oneDNN kernels, caches)
        decode(e)
    times, texts = {k: [] for k in engines}, {}
    for _ in range(reps):
        for k, e in engines.items():
            e.blocks.reset_prefix_cache()  # every repetition computes its prompts
            seconds, texts[k] = decode(e)
            times[k].append(seconds)
    return times, texts


if __name__ == "__main__":
    raise SystemExit(main())
