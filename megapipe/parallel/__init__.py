"""Parallelism applied from outside the model (torchtitan order): dims.py (layout + DeviceMesh), distributed.py
(process group), tp.py (tensor/sequence parallel, vocab-parallel loss), cp.py (ring attention), pp.py (stages +
schedules), dp.py (FSDP2/HSDP/DDP), recompute.py (activation recompute, compile), parallelize.py (applies them),
step.py (train/eval step + gradient clipping for any layout), launch.py (torchrun re-launch), layout_run.py
(a few steps in one layout, for tools/loss_compare.py and tools/bench_parallel.py)."""
