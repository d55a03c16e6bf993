"""The shared checkpoint format every stage reads and writes: one directory per checkpoint.

``CKPT/megapipe.json`` is the manifest (format version, model config, tokenizer, layout, step, stage, parent,
quantization, and every file with its size and checksum; written last, so a cut-off save never looks complete:
manifest.py, integrity.py). ``model/`` and ``optim/`` hold torch.distributed.checkpoint shards that load into any
parallel layout (dcp.py, read without unpickling code: safe_dcp.py), ``extra/`` the per-rank RNG states (rng.py),
``tokenizer/`` the tokenizer. Saves go to a temporary sibling renamed into place; hf/ and trt*.py write other formats.
"""

from megapipe.checkpoint.dcp import (
    load_checkpoint,
    prune,
    save_checkpoint,
    write_checkpoint,
)
from megapipe.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    find_latest,
    is_complete,
    lineage,
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "find_latest",
    "is_complete",
    "lineage",
    "list_checkpoints",
    "load_checkpoint",
    "prune",
    "read_manifest",
    "resolve_checkpoint",
    "save_checkpoint",
    "write_checkpoint",
]
