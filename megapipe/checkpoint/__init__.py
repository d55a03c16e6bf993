"""The shared checkpoint format (see DESIGN.md): DCP shards + a JSON manifest, atomic saves, safe loads."""

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
