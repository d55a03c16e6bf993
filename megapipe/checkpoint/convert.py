"""Looking into a checkpoint (``megapipe checkpoint inspect``) and consolidating it to one safetensors file.

The safetensors file is written by hand (8-byte header length, JSON header, raw little-endian bytes) so the
tensors can be streamed: the header is known from the DCP metadata before any tensor is read, and tensors are
then loaded (resharded to full size) a few hundred MB at a time and appended.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Optional, Union

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapipe.checkpoint import integrity
from megapipe.checkpoint.dcp import dcp_load, verify_checkpoint
from megapipe.checkpoint.manifest import (
    MANIFEST_NAME,
    fsync_dir,
    lineage,
    make_tmp_dir,
    read_manifest,
    resolve_checkpoint,
    tmp_name,
    write_bytes_durable,
)
from megapipe.checkpoint.safe_dcp import check_shards, read_metadata
from megapipe.errors import CheckpointError
from megapipe.fileio import refuse_overlap

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def model_tensors(ckpt: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (full shape, dtype) of every tensor in ``ckpt/model``."""
    md = read_metadata(ckpt / "model")
    return {
        k: (tuple(m.size), m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def verify(ckpt: Union[str, Path]) -> dict:
    """Every file of one checkpoint against its manifest (size, checksum) and the DCP metadata against its shards,
    without loading a tensor: {path, step, files, checked, algorithm, problems, extra_files}."""
    ckpt = Path(ckpt)
    report = {"path": str(ckpt), "step": None, "files": 0, "checked": 0, "algorithm": None, "problems": [],
              "extra_files": []}
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as e:
        report["problems"].append(str(e))
        return report
    report["step"] = manifest.get("step")
    if manifest.get("complete") is not True:
        report["problems"].append(f"{ckpt / MANIFEST_NAME} marks the checkpoint incomplete")
    names = integrity.select(manifest, [""])
    sums = integrity.recorded(manifest)
    report["files"], report["algorithm"] = len(names), integrity.ALGORITHM if sums is not None else None
    report["checked"] = len([n for n in names if sums and n in sums])
    report["problems"] += integrity.problems(ckpt, manifest, names)
    listed = set(names) | {MANIFEST_NAME}
    report["extra_files"] = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")
                                   if p.is_file() and p.relative_to(ckpt).as_posix() not in listed)
    for sub in ("model", "optim"):
        if (ckpt / sub / ".metadata").is_file() or sub == "model":
            try:
                check_shards(ckpt / sub, read_metadata(ckpt / sub))
            except CheckpointError as e:
                if str(e) not in report["problems"]:
                    report["problems"].append(str(e))
    return report


def summary(ckpt: Union[str, Path], check: bool = True) -> dict:
    """What ``megapipe checkpoint inspect`` shows, as plain JSON-able data; ``check`` verifies the checksums first
    (a damaged checkpoint is a CheckpointError naming the file)."""
    ckpt = resolve_checkpoint(ckpt)
    manifest = read_manifest(ckpt)
    integrity_row = "not checked (--no-verify)"
    if check:
        found = integrity.problems(ckpt, manifest, integrity.select(manifest, [""]))
        if found:
            raise integrity.damaged_error(ckpt, found)
        sums = integrity.recorded(manifest)
        integrity_row = (f"ok: {len(sums)} files match their {integrity.ALGORITHM} checksums" if sums is not None
                         else "no checksums recorded (saved by an older megapipe): sizes only")
    tensors = model_tensors(ckpt)
    by_dtype: dict[str, int] = {}
    for shape, dtype in tensors.values():
        name = str(dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + _numel(shape)
    extra = ckpt / "extra"
    return {
        "path": str(ckpt),
        "step": manifest.get("step"),
        "stage": manifest.get("stage"),
        "created": manifest.get("created"),
        "format_version": manifest.get("format_version"),
        "tokens_seen": manifest.get("tokens_seen"),
        "parameters": sum(_numel(s) for s, _ in tensors.values()),
        "tensors": len(tensors),
        "parameters_by_dtype": by_dtype,
        "optimizer_state": (ckpt / "optim" / ".metadata").is_file(),
        "rng_ranks": len(list(extra.glob("rng_rank*.safetensors"))) if extra.is_dir() else 0,
        "tokenizer": str(ckpt / "tokenizer") if (ckpt / "tokenizer").is_dir() else manifest.get("tokenizer"),
        "layout": manifest.get("layout"),
        "model": manifest.get("model"),
        "quantization": manifest.get("quantization"),
        "data_state": manifest.get("data_state"),
        "trainer_state": manifest.get("trainer_state"),
        "lineage": lineage(ckpt),
        "size_bytes": _dir_size(ckpt),
        "integrity": integrity_row,
    }


def to_safetensors(
    ckpt: Union[str, Path],
    out: Union[str, Path],
    dtype: Optional[torch.dtype] = None,
    batch_bytes: int = 256 << 20,
) -> Path:
    """Write ``out/model.safetensors`` (full, consolidated weights), ``out/config.json`` (the ModelConfig) and
    ``out/megapipe.json`` (the source manifest). ``dtype`` casts floating-point tensors. Single process."""
    given = ckpt
    ckpt = resolve_checkpoint(ckpt)
    manifest = read_manifest(ckpt)
    out = Path(out)
    refuse_overlap([out], [given, ckpt], CheckpointError)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"output {out} already exists and is not an empty directory: choose another path")
    verify_checkpoint(ckpt, manifest, ["model/"])
    stored = model_tensors(ckpt)
    tensors = {k: (s, dtype if dtype is not None and d.is_floating_point else d) for k, (s, d) in stored.items()}
    for k, (_, d) in tensors.items():
        if d not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{ckpt}/model: tensor '{k}' has dtype {d}, which safetensors cannot store")

    header: dict = {"__metadata__": {"format": "pt", "source": str(ckpt), "step": str(manifest.get("step"))}}
    offset = 0
    for k, (shape, d) in tensors.items():
        size = _numel(shape) * torch.empty((), dtype=d).element_size()
        header[k] = {"dtype": SAFETENSORS_DTYPES[d], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    tmp = tmp_name(out.absolute())
    make_tmp_dir(tmp, out)
    try:
        with open(tmp / "model.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for batch in _batches(tensors, batch_bytes):
                state = {k: torch.empty(stored[k][0], dtype=stored[k][1]) for k in batch}
                dcp_load(state, ckpt / "model", "model", strict=False)
                for k in batch:
                    t = state.pop(k).to(tensors[k][1]).contiguous().reshape(-1)
                    f.write(memoryview(t.view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        write_bytes_durable(tmp / "config.json", (json.dumps(manifest.get("model"), indent=2) + "\n").encode())
        write_bytes_durable(tmp / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        fsync_dir(out.parent)
    except OSError as e:  # disk full, file-size limit: name the file; nothing is left at OUT
        shutil.rmtree(tmp, ignore_errors=True)
        name = e.filename or tmp / "model.safetensors"
        raise CheckpointError(f"cannot write {out}: writing {name} failed ({e.strerror or e}); nothing was "
                              "kept") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / "model.safetensors"


def _batches(tensors: dict, budget: int):
    batch, size = [], 0
    for k, (shape, d) in tensors.items():
        n = _numel(shape) * torch.empty((), dtype=d).element_size()
        if batch and size + n > budget:
            yield batch
            batch, size = [], 0
        batch.append(k)
        size += n
    if batch:
        yield batch
