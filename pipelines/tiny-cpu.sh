#!/usr/bin/env bash
# The README's main job on the bundled default: a real corpus -> tokenizer -> .bin/.idx -> (pretrain -> generate).
set -euo pipefail
OUT=${OUT:-runs/tiny-cpu}
mkdir -p "$OUT"
megapipe data fetch shakespeare --output "$OUT/shakespeare.jsonl"
megapipe tokenizer train --input "$OUT/shakespeare.jsonl" --vocab-size 4096 --output "$OUT/tokenizer"
megapipe preprocess --input "$OUT/shakespeare.jsonl" --output-prefix "$OUT/shakespeare" \
    --tokenizer "$OUT/tokenizer" --append-eod --workers 2
megapipe data inspect "$OUT/shakespeare_text_document"
