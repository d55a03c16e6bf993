#!/usr/bin/env bash
# The README's main job on the bundled default: a real corpus -> tokenizer -> .bin/.idx -> pretrain -> generate.
# Pretraining the `tiny` preset (4M parameters, 400 steps x 2k tokens) takes ~4 minutes on 2 idle CPU cores.
set -euo pipefail
OUT=${OUT:-runs/tiny-cpu}
STEPS=${STEPS:-400}
mkdir -p "$OUT"
megapipe data fetch shakespeare --output "$OUT/shakespeare.jsonl"
megapipe tokenizer train --input "$OUT/shakespeare.jsonl" --vocab-size 4096 --output "$OUT/tokenizer"
megapipe preprocess --input "$OUT/shakespeare.jsonl" --output-prefix "$OUT/shakespeare" \
    --tokenizer "$OUT/tokenizer" --append-eod --workers 2
megapipe data inspect "$OUT/shakespeare_text_document"
# --load of the run's own directory: a second `make demo` resumes (or, when finished, only re-evaluates).
megapipe pretrain --data-path "$OUT/shakespeare_text_document" --tokenizer "$OUT/tokenizer" --model tiny \
    --seq-length 128 --micro-batch-size 16 --global-batch-size 16 --train-iters "$STEPS" \
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 40 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --split 98,2,0 --eval-interval 200 --eval-iters 4 --log-interval 20 \
    --save "$OUT/pretrain" --save-interval 200 --load "$OUT/pretrain"
megapipe generate "$OUT/pretrain" --prompt "To be, or not to be" --prompt "My lord," --max-new-tokens 48 \
    --temperature 0.8 --top-k 40 --seed 1
