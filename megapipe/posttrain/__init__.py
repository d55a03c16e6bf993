"""Post-training stages on the shared checkpoint format: quantize (NVIDIA ModelOpt PTQ, quantize.py)."""
