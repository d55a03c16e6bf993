"""Benchmark `megapipe posttrain quantize`: perplexity change and calibration time per format, next to the baseline of
the same weights quantized by ModelOpt's usual Hugging Face flow (the HF twin), measured in the same run.

Models: SmolLM2-135M-Instruct (when prepared by tools/prepare_smollm2.py) and a tiny Llama trained here by
`megapipe pretrain` (the tiny preset, its MLP widened to 768 so INT4 blocks of 128 fit). Data: the Shakespeare
corpus (`megapipe data fetch shakespeare`), tokenized with each model's tokenizer; the first windows calibrate, the
next ones (held out) measure the perplexity. Each quantized checkpoint is also exported (`export trt`, unified) and
its size compared with the unquantized export's.

    python tools/bench_quantize.py [--work DIR] [--formats fp8,int8_sq,int4_awq,w4a8_awq] [--calib-samples 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megapipe.checkpoint.load import load_model  # noqa: E402
from megapipe.checkpoint.trt import export_trt  # noqa: E402
from megapipe.errors import MegapipeError  # noqa: E402
from megapipe.posttrain.quantize import calibrate, evaluate, quantize_checkpoint, token_stream, windows  # noqa: E402

SMOLLM2 = Path("~/.cache/megapipe/smollm2").expanduser()


def megapipe(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "megapipe.cli", *args, "--quiet"], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def corpus(work: Path) -> Path:
    out = work / "shakespeare.jsonl"
    if not out.exists():
        megapipe("data", "fetch", "shakespeare", "--output", str(out))
    return out


def tokenized(work: Path, name: str, text: Path, tokenizer_dir: Path) -> Path:
    from megapipe.data.preprocess import preprocess
    from megapipe.data.tokenizer import load_tokenizer

    prefix = work / f"{name}-data" / "shakespeare"
    if not Path(f"{prefix}_text_document.idx").exists():
        preprocess([str(text)], prefix, load_tokenizer(tokenizer_dir), append_eod=True, workers=2)
    return Path(f"{prefix}_text_document")


def smollm2_checkpoint(work: Path) -> Path:
    from megapipe.checkpoint.hf import import_hf

    out = work / "smollm2-ckpt"
    if not out.exists():
        import_hf(SMOLLM2, out)
    return out


def tiny_checkpoint(work: Path, text: Path, steps: int) -> Path:
    run = work / "tiny-run"
    if (run / "latest").exists():
        return run
    tok = work / "tiny-tokenizer"
    if not tok.exists():
        megapipe("tokenizer", "train", "--input", str(text), "--vocab-size", "4096", "--output", str(tok))
    prefix = tokenized(work, "tiny", text, tok)
    megapipe("pretrain", "--data-path", str(prefix), "--tokenizer", str(tok), "--model", "tiny",
             "--set", "model.intermediate_size=768", "--seq-length", "128", "--micro-batch-size", "16",
             "--global-batch-size", "16", "--train-iters", str(steps), "--lr", "2e-3", "--min-lr", "2e-4",
             "--lr-warmup-iters", str(max(1, steps // 10)), "--weight-decay", "0.1", "--split", "98,2,0",
             "--log-interval", "50", "--save", str(run), "--save-interval", str(steps))
    return run


def size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def bench_model(name: str, ckpt: Path, data: Path, args, work: Path) -> list[dict]:
    samples, seq, batch = args.calib_samples, args.seq_len, args.batch_size
    slug = name.split()[0].lower()
    stream = token_stream(data, None, (samples + args.eval_iters * batch) * seq + 1)
    calib = windows(stream, samples, seq)[:, :-1]
    evals = windows(stream, args.eval_iters * batch, seq, first=samples)
    export_trt(ckpt, work / f"{slug}-bf16", "unified", dtype="bf16", overwrite=True)
    bf16_bytes = size(work / f"{slug}-bf16")
    rows = []
    for fmt in args.formats:
        out = work / f"{slug}-{fmt}"
        summary = quantize_checkpoint(ckpt, out, fmt, data, kv_cache=args.kv, calib_samples=samples, seq_length=seq,
                                      batch_size=batch, eval_iters=args.eval_iters, overwrite=True)
        row = {"model": name, "format": summary["format"], "ppl_base": summary["perplexity_before"],
               "ppl": summary["perplexity_after"], "change": summary["perplexity_change"],
               "calib_s": summary["calibration_seconds"]}
        restored = load_model(out).model
        row["ppl_restored"] = evaluate(restored, evals, batch)["perplexity"]
        if args.hf:
            twin = hf_twin(ckpt, work / f"{slug}-hf")
            t0 = time.perf_counter()
            calibrate(twin, fmt, args.kv, calib, batch)
            row["hf_calib_s"] = time.perf_counter() - t0
            row["ppl_hf"] = evaluate(lambda t, m=twin: m(t).logits, evals, batch)["perplexity"]
            del twin
        try:
            export_trt(out, work / f"{slug}-{fmt}-unified", "unified", dtype="bf16", overwrite=True)
            row["size_ratio"] = size(work / f"{slug}-{fmt}-unified") / bf16_bytes
        except MegapipeError as e:
            row["size_ratio"] = None
            row["export"] = str(e).split(": ", 1)[-1][:80]
        rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(work / f"{slug}-{fmt}-unified", ignore_errors=True)
    return rows


def hf_twin(ckpt: Path, directory: Path):
    import transformers

    from megapipe.checkpoint.hf import export_hf

    if not directory.exists():
        export_hf(ckpt, directory, dtype="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="posttrain quantize: perplexity (held-out Shakespeare windows) and calibration time, fake quant")
    for col in ("model", "format", "ppl base", "ppl quant", "change", "vs HF twin", "calib s", "HF calib s",
                "time ratio", "size vs bf16"):
        t.add_column(col, justify="left" if col in ("model", "format") else "right")
    for r in rows:
        hf = r.get("ppl_hf")
        t.add_row(r["model"], r["format"], f"{r['ppl_base']:.3f}", f"{r['ppl']:.3f}", f"{100 * r['change']:+.2f} %",
                  f"{100 * (r['ppl'] / hf - 1):+.4f} %" if hf else "-", f"{r['calib_s']:.1f}",
                  f"{r['hf_calib_s']:.1f}" if hf else "-", f"{r['calib_s'] / r['hf_calib_s']:.2f}x" if hf else "-",
                  f"{r['size_ratio']:.2f}x" if r["size_ratio"] else "n/a: " + r.get("export", "")[:40])
    Console().print(t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_quantize")
    p.add_argument("--formats", default="fp8,int8_sq,int4_awq,w4a8_awq")
    p.add_argument("--kv", default=None, help="KV-cache format (fp8) for every run")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--tiny-steps", type=int, default=400)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="Skip the ModelOpt-on-HF baseline")
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--skip-tiny", action="store_true")
    args = p.parse_args()
    args.formats = args.formats.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    text = corpus(args.work)
    rows = []
    if not args.skip_tiny:
        ckpt = tiny_checkpoint(args.work, text, args.tiny_steps)
        rows += bench_model("tiny (trained)", ckpt, tokenized(args.work, "tiny", text, args.work / "tiny-tokenizer"),
                            args, args.work)
    if not args.skip_smollm2:
        if (SMOLLM2 / "config.json").is_file():
            ckpt = smollm2_checkpoint(args.work)
            rows += bench_model("SmolLM2-135M", ckpt, tokenized(args.work, "smollm2", text, SMOLLM2), args, args.work)
        else:
            print(f"SmolLM2 is not prepared at {SMOLLM2} (tools/prepare_smollm2.py): skipped")
    table(rows)


if __name__ == "__main__":
    main()
