"""torch.distributed.checkpoint (DCP) reading without unpickling code, plus strict key/shape checks.

What torch 2.13 does when reading a DCP directory (checked in its source, ``torch/distributed/checkpoint``):
- tensor payloads: ``torch.load(..., weights_only=True)`` (filesystem.py): safe;
- ``.metadata``: ``pickle.load`` with no restriction (``FileSystemReader.read_metadata``): a crafted file runs code;
- non-tensor values (e.g. optimizer ``lr``/``betas``): ``torch.load(..., weights_only=False)``
  (``DefaultLoadPlanner.load_bytes``): also runs code.
So the reader below unpickles ``.metadata`` with an allowlist of DCP's own dataclasses, torch.Size/dtypes/layouts
and pathlib paths, and the planner loads non-tensor values with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from megapipe import torch_compat
from megapipe.errors import CheckpointError

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch._utils": {"_get_layout"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_metadata(path: str | Path) -> Metadata:
    """Read ``path/.metadata`` safely; a CheckpointError names the file when it is missing or damaged."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete") from None
    except Exception as e:  # noqa: BLE001 - a damaged file may fail in any way while unpickling
        raise CheckpointError(f"{file}: corrupted or untrusted DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: not DCP metadata (found {type(metadata).__name__})")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled with an allowlist and whose shard files are checked up front."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_shards(path: Path, metadata: Metadata) -> None:
    """Every shard file the metadata refers to exists and is long enough."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(needed.items()):
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"shard file {file} is missing: the checkpoint is incomplete")
        if file.stat().st_size < end:
            raise CheckpointError(f"shard file {file} is truncated ({file.stat().st_size} bytes, needs {end})")


def _names(keys: set[str], limit: int = 6) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


class StrictLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses missing keys, unexpected keys and shape mismatches with a clear sentence,
    and reads non-tensor values with ``weights_only=True``."""

    def __init__(self, where: str, what: str = "model", allow_unexpected: bool = False,
                 ignore: Optional[Callable[[str], bool]] = None) -> None:
        super().__init__()
        self.where, self.what, self.allow_unexpected = where, what, allow_unexpected
        self.ignore = ignore  # checkpoint keys the caller leaves unread on purpose

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        stored = self.metadata.state_dict_metadata
        missing = set(self.state_dict) - set(stored)
        if missing:
            raise CheckpointError(
                f"{self.where} does not match the {self.what}: keys missing from the checkpoint: {_names(missing)}"
            )
        for key, value in self.state_dict.items():
            meta = stored[key]
            if isinstance(value, torch.Tensor) != isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{self.where}: '{key}' is a tensor in only one of checkpoint and {self.what}")
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(meta.size):
                raise CheckpointError(
                    f"{self.where}: '{key}' has shape {list(meta.size)} in the checkpoint "
                    f"but {list(value.shape)} in the {self.what}"
                )

    def create_global_plan(self, global_plan):
        # The union over ranks (pipeline stages hold different keys); only the coordinator runs this.
        if self.allow_unexpected:
            return super().create_global_plan(global_plan)
        used = {item.dest_index.fqn for plan in global_plan for item in plan.items}
        unexpected = {
            k
            for k, m in self.metadata.state_dict_metadata.items()
            if k not in used and not (isinstance(m, TensorStorageMetadata) and _numel(m.size) == 0)
            and not (self.ignore is not None and self.ignore(k))
        }
        if unexpected:
            raise CheckpointError(
                f"{self.where} does not match the {self.what}: keys in the checkpoint that the {self.what} "
                f"lacks: {_names(unexpected)}"
            )
        return super().create_global_plan(global_plan)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:

            torch_compat.set_state_dict_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _numel(size) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def unwrap(exc: BaseException) -> BaseException:
    """DCP wraps errors raised on any rank into a CheckpointException; return our own CheckpointError if inside."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                return inner
    return exc
