"""Parallelism applied from outside the model (torchtitan order): dims.py (layout + DeviceMesh), distributed.py
(process group), tp.py (tensor/sequence parallel, vocab-parallel loss), cp.py (ring attention), pp.py (stages +
schedules), ep.py (expert parallelism, MoE statistics), dp.py (FSDP2/HSDP/DDP), recompute.py (activation
recompute, compile), parallelize.py (applies them), step.py (train/eval step + gradient clipping for any layout),
launch.py (torchrun re-launch), plan.py (the layout planner: memory and FLOPs per rank)."""
