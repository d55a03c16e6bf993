"""Decoder-only transformer models (no parallel code here: parallelism is applied from megapipe.parallel)."""
