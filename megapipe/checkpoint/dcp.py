"""The shared checkpoint format: save and load a model (+ optimizer, RNG, trainer state) in any parallel layout.

``CKPT/megapipe.json`` (manifest), ``model/`` and ``optim/`` (DCP shards), ``extra/`` (per-rank RNG),
``tokenizer/``. Model and optimizer states go through ``torch.distributed.checkpoint.state_dict`` so DTensor /
FSDP2 / TP shards are written as they are and resharded to whatever layout loads them. The optimizer state is
flattened per parameter name (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), so it does not depend on how
parameters were grouped or split over pipeline stages. ``model`` may be one module or a list of pipeline parts
(with one optimizer per part).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import megapipe.checkpoint.integrity as integrity  # the module alone: the package's __init__ imports this one
from megapipe.checkpoint.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    SIZES_ONLY_VERSION,
    fsync_dir,
    is_complete,
    list_checkpoints,
    list_files,
    make_tmp_dir,
    new_manifest,
    read_manifest,
    resolve_checkpoint,
    step_dir_name,
    tmp_name,
    write_bytes_durable,
    write_text_atomic,
)
from megapipe.checkpoint.rng import restore_rng, rng_file, save_rng
from megapipe.checkpoint.safe_dcp import SafeReader, StrictLoadPlanner, check_shards, read_metadata, unwrap
from megapipe.errors import CheckpointError
from megapipe.models.mtp import is_mtp_key
from megapipe.parallel.distributed import get_rank, get_world_size, is_distributed

Modules = Union[nn.Module, Sequence[nn.Module]]
Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- distributed


def _broadcast_str(value: str) -> str:
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ok(ok: bool) -> bool:
    """True when ``ok`` holds on every rank (so one failing rank makes all of them stop together)."""
    if not is_distributed():
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# --------------------------------------------------------------------------------------------------- state dicts


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _model_states(parts: list[nn.Module]) -> list[dict]:
    return [get_model_state_dict(p) for p in parts]


def _optim_states(parts: list[nn.Module], optims: list) -> list[dict]:
    if len(optims) != len(parts):
        raise ValueError(f"got {len(parts)} model parts but {len(optims)} optimizers: pass one optimizer per part")
    return [get_optimizer_state_dict(p, o, options=_OPTIM_OPTIONS) for p, o in zip(parts, optims, strict=True)]


def _merge(states: list[dict], what: str) -> dict:
    merged: dict = {}
    for sd in states:
        clash = merged.keys() & sd.keys()
        if clash:
            raise ValueError(f"{what} parts share state keys {sorted(clash)[:3]}: each part must hold different ones")
        merged.update(sd)
    return merged


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process call that it is single-process; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_save(state: dict, path: Path, digests: Optional[dict]) -> None:
    """Write DCP shards of ``state`` at ``path``; the digests of the files this rank wrote go into ``digests``
    (None: no checksums, for benchmarks)."""
    writer = FileSystemWriter(path, sync_files=True)
    writer.fs = fs = integrity.HashingFileSystem(hashing=digests is not None)
    try:
        with _quiet_single_process():
            dcp.save(state, storage_writer=writer, no_dist=not is_distributed())
    except CheckpointException as e:  # DCP's wrapper of what failed on any rank: show the cause itself
        raise (fs.error or _write_failure(e)) from None
    except Exception:
        if fs.error is not None:  # a failed write surfaces from torch.save as an unrelated RuntimeError
            raise fs.error from None
        raise
    finally:
        if digests is not None:
            digests.update(fs.digests)


def _write_failure(e: BaseException) -> BaseException:
    failures = getattr(e, "failures", None) or {}
    for failure in failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, (OSError, CheckpointError)):
            return inner
    return CheckpointError(f"writing checkpoint shards failed: {str(e).strip().splitlines()[-1]}")


def _os_error(what: str, e: OSError) -> CheckpointError:
    where = f"cannot write {e.filename}" if e.filename else "a write failed"
    return CheckpointError(f"{what} failed: {where} ({e.strerror or e}); nothing of this save was kept")


def dcp_load(state: dict, path: Path, what: str, strict: bool = True, verify: bool = True,
             ignore: Optional[Callable[[str], bool]] = None) -> None:
    """Load the DCP shards of checkpoint part ``path`` (``CKPT/model``, ``CKPT/optim``) into ``state`` in place: the
    one reader of checkpoint tensors. Its files are verified against their checksums first (``verify_checkpoint``;
    ``verify=False`` only for benchmarks); every mismatch is a CheckpointError (see safe_dcp). ``ignore(key)``:
    checkpoint keys left unread on purpose. Collective."""
    if verify:
        verify_checkpoint(path.parent, read_manifest(path.parent), [f"{path.name}/"])
    check_shards(path, read_metadata(path))  # before DCP, which would bury these errors in its own
    planner = StrictLoadPlanner(str(path), what, allow_unexpected=not strict, ignore=ignore)
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeReader(path), planner=planner, no_dist=not is_distributed())
    except CheckpointException as e:  # what DCP raises on every rank when any rank failed (a BaseException)
        inner = unwrap(e)
        if inner is not e:
            raise inner from None
        raise CheckpointError(f"the shards in {path} are damaged and cannot be read ({_cause(e)}); "
                              f"`megapipe checkpoint verify {path.parent}` names the files") from None


def _cause(e: BaseException) -> str:
    """The first sentence of the root failure, without torch's advice to unpickle with weights_only=False (which
    would run code from a file that is already known to be damaged)."""
    failures = getattr(e, "failures", None) or {}
    inner = next(iter(failures.values()), e) if failures else e
    inner = inner[0] if isinstance(inner, tuple) else inner
    text = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
    for marker in ("weights_only", "Weights only", "Re-running", "If you are seeing this", "This is an internal"):
        text = text.split(marker)[0]
    return text.strip().rstrip(".:,;(") or type(inner).__name__


def verify_checkpoint(ckpt: Path, manifest: dict, prefixes: Sequence[str]) -> None:
    """Check the checksums of ``ckpt``'s files under ``prefixes`` (``model/``, ``optim/``, ``extra/``), every rank
    a share of the files; every rank raises the same CheckpointError naming the first damaged file. Files verified
    earlier in this process and unchanged since are not hashed again. Collective."""
    files = integrity.select(manifest, prefixes)
    if _all_ok(not integrity.unverified(ckpt, files)):
        return
    world = get_world_size()
    found = integrity.verify_files(ckpt, manifest, files, get_rank(), world)
    if is_distributed():
        everyone: list = [None] * world
        dist.all_gather_object(everyone, found)
        found = [p for part in everyone for p in part]
    if found:
        raise integrity.damaged_error(ckpt, found)
    integrity.remember(ckpt, files)


# --------------------------------------------------------------------------------------------------- saving


def write_checkpoint(
    path: Union[str, Path],
    model: Modules,
    optimizer: Optimizers = None,
    *,
    step: int = 0,
    extra_state: Optional[dict] = None,
    manifest: Optional[dict] = None,
    tokenizer: Any = None,
    checksums: bool = True,
) -> Path:
    """Write one checkpoint at exactly ``path`` (atomically: temporary sibling, fsync, rename). Collective.
    ``checksums=False`` records none (only for benchmarks: such a checkpoint cannot be verified)."""
    final = Path(path).absolute()
    tmp = Path(_broadcast_str(str(tmp_name(final))))
    parts, optims = _as_list(model), _as_list(optimizer)
    what = f"saving checkpoint {final}"
    digests: Optional[dict] = {} if checksums else None  # absolute path -> checksum of the files this rank wrote
    try:
        _together(what, lambda: make_tmp_dir(tmp, final, "extra"), rank0_only=True)
        _together(what, lambda: _write_states(tmp, parts, optims, digests))
        digests = _gather(digests) if checksums else None
        _together(what, lambda: _commit(tmp, final, step, extra_state, manifest, tokenizer, digests), rank0_only=True)
    except OSError as e:  # disk full, file-size limit, read-only file system: name the file
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _os_error(what, e) from None
    except BaseException:
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_states(tmp: Path, parts: list, optims: list, digests: dict) -> None:
    _dcp_save(_merge(_model_states(parts), "model"), tmp / "model", digests)
    if optims:
        _dcp_save(_merge(_optim_states(parts, optims), "optimizer"), tmp / "optim", digests)
    path = rng_file(tmp / "extra", get_rank())
    digest = save_rng(path)
    if digests is not None:
        digests[str(path.absolute())] = digest


def _gather(digests: dict) -> dict:
    """Every rank's digests, on rank 0 (the one writing the manifest)."""
    if not is_distributed():
        return digests
    parts: Optional[list] = [None] * dist.get_world_size() if get_rank() == 0 else None
    dist.gather_object(digests, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else {}


def _together(what: str, fn: Callable[[], Any], rank0_only: bool = False) -> None:
    """Run ``fn`` (on every rank, or rank 0 only); when it fails on any rank, every rank raises."""
    error: Optional[Exception] = None
    if not rank0_only or get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
            error = e
    if not _all_ok(error is None):
        if error is not None:
            raise error
        raise CheckpointError(f"{what} failed on another rank (see its log)")


def _commit(tmp: Path, final: Path, step: int, extra_state, fields, tokenizer, digests: Optional[dict]) -> None:
    fields = dict(fields or {})
    if extra_state:
        fields["trainer_state"] = {**(fields.get("trainer_state") or {}), **extra_state}
    if tokenizer is not None:
        fields["tokenizer"] = _copy_tokenizer(tokenizer, tmp / "tokenizer")
    if fields.get("parent"):
        fields["parent"] = str(Path(fields["parent"]).absolute())
    fields.setdefault("layout", {"world_size": get_world_size()})
    manifest = new_manifest(step, fields)
    manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest["complete"] = True
    manifest["files"] = list_files(tmp)
    if digests is None:  # as before checksums existed: the version says so, and verifying checks sizes only
        manifest["format_version"] = SIZES_ONLY_VERSION
    else:
        manifest["checksum_algorithm"] = integrity.ALGORITHM
        manifest["checksums"] = integrity.digests_for(tmp, manifest["files"], digests)
    write_bytes_durable(tmp / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
    for sub in ("model", "optim", "extra", "tokenizer", "."):
        if (tmp / sub).is_dir():
            fsync_dir(tmp / sub)
    old = None
    if final.exists():  # the same step saved again (e.g. after a resume): swap it out, then delete it
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _copy_tokenizer(tokenizer: Any, dest: Path) -> dict:
    """Copy tokenizer files (a directory, a tokenizer.json file, or an object with ``save_pretrained``)."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(dest))
        source = getattr(tokenizer, "name_or_path", None)
    else:
        src = Path(tokenizer)
        if src.is_dir():
            shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".*"))
        elif src.is_file():
            dest.mkdir(parents=True)
            shutil.copy2(src, dest / src.name)
        else:
            raise CheckpointError(f"tokenizer {src} does not exist")
        source = str(src.absolute())
    for dirpath, _, names in os.walk(dest):
        for name in names:
            with open(Path(dirpath) / name, "rb+") as f:
                os.fsync(f.fileno())
    return {"path": "tokenizer", "source": source}


def save_checkpoint(
    run_dir: Union[str, Path],
    step: int,
    model: Modules,
    optimizer: Optimizers = None,
    extra_state: Optional[dict] = None,
    manifest: Optional[dict] = None,
    tokenizer: Any = None,
    keep_last: Optional[int] = None,
    checksums: bool = True,
) -> Path:
    """Save ``run_dir/step_{step:08d}``, point ``run_dir/latest`` at it, keep the newest ``keep_last``. Collective."""
    run_dir = Path(run_dir)
    final = write_checkpoint(
        run_dir / step_dir_name(step),
        model,
        optimizer,
        step=step,
        extra_state=extra_state,
        manifest=manifest,
        tokenizer=tokenizer,
        checksums=checksums,
    )

    def point_and_prune() -> None:
        write_text_atomic(run_dir / LATEST_NAME, final.name + "\n")
        if keep_last:
            prune(run_dir, keep_last, protect=final)

    try:
        _together(f"updating {run_dir / LATEST_NAME}", point_and_prune, rank0_only=True)
    except OSError as e:  # the new checkpoint is complete; `latest` still names the previous one
        raise CheckpointError(f"{final} was saved, but {run_dir / LATEST_NAME} could not be updated to name it "
                              f"({e.strerror or e}: {e.filename})") from None
    return final


def prune(run_dir: Path, keep_last: int, protect: Optional[Path] = None) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last`` and leftovers of cut-off saves."""
    complete = [p for _, p in list_checkpoints(run_dir) if is_complete(p)]
    doomed = [p for p in complete[: max(0, len(complete) - keep_last)] if protect is None or p.absolute() != protect]
    for child in Path(run_dir).iterdir():
        if child.is_dir() and (".tmp-" in child.name or ".old-" in child.name) and child.name.startswith("step_"):
            doomed.append(child)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# --------------------------------------------------------------------------------------------------- loading


def load_checkpoint(
    ckpt: Union[str, Path],
    model: Modules,
    optimizer: Optimizers = None,
    load_optim: bool = True,
    load_rng: bool = True,
    verify: bool = True,
    skip: Optional[Callable[[str], bool]] = None,
    new_mtp: bool = False,
) -> dict:
    """Load ``ckpt`` (a checkpoint or a run dir: its newest complete one) into ``model`` in its current layout.

    ``load_optim=False`` takes the weights only (``--finetune``). Every file read is first checked against the
    checksum the manifest recorded (``verify=False`` skips that, for benchmarks). ``skip(name)`` marks model state
    the checkpoint does not hold (a new run's LoRA adapters): it keeps its values. Multi-token prediction modules
    follow ``mtp_rule``; ``new_mtp``: a new pretraining run, whose MTP modules may start fresh. Returns the
    manifest. Collective.
    """
    ckpt = resolve_checkpoint(ckpt)
    manifest = read_manifest(ckpt)
    parts, optims = _as_list(model), _as_list(optimizer)
    if verify:
        wanted = ["model/"] + (["optim/"] if optims and load_optim else []) + (["extra/"] if load_rng else [])
        verify_checkpoint(ckpt, manifest, wanted)

    states = _model_states(parts)
    skip = mtp_rule(ckpt, states, new_mtp, skip)
    if skip is not None:
        states = [{k: v for k, v in sd.items() if not skip(k)} for sd in states]
    merged = _merge(states, "model")
    # what the model does not load (skip) is left unread in the checkpoint too (a language model's output
    # projection under a new reward head)
    unread = is_mtp_key if skip is None else (lambda k: is_mtp_key(k) or skip(k))
    dcp_load(merged, ckpt / "model", "model", verify=verify, ignore=unread)
    options = StateDictOptions(strict=skip is None)
    for part, sd in zip(parts, states, strict=True):
        set_model_state_dict(part, {k: merged[k] for k in sd}, options=options)

    if optims and load_optim:
        if not (ckpt / "optim" / ".metadata").is_file():
            raise CheckpointError(
                f"{ckpt} holds no optimizer state (no optim/): load its weights only (--finetune) to start a new run"
            )
        states = _optim_states(parts, optims)
        merged = _merge(states, "optimizer")
        dcp_load(merged, ckpt / "optim", "optimizer", verify=verify, ignore=is_mtp_key)
        for part, opt, sd in zip(parts, optims, states, strict=True):
            set_optimizer_state_dict(part, opt, {k: merged[k] for k in sd}, options=_OPTIM_OPTIONS)

    if load_rng:
        path = rng_file(ckpt / "extra", get_rank())
        if path.is_file():
            restore_rng(path)
    return manifest


def mtp_rule(ckpt: Path, states: list[dict], new_mtp: bool,
             skip: Optional[Callable[[str], bool]]) -> Optional[Callable[[str], bool]]:
    """The one rule for multi-token prediction modules at load: a checkpoint's MTP tensors load into a model with
    them, and are left unread (with a log line) by a model without; a model with MTP modules refuses a checkpoint
    without them, unless ``new_mtp`` (a new pretraining run: they keep their fresh values). Returns ``skip``
    widened to the MTP keys in that last case."""
    ours = any(is_mtp_key(k) for sd in states for k in sd)
    stored = any(is_mtp_key(k) for k in read_metadata(ckpt / "model").state_dict_metadata)
    if stored and not ours:
        log.info("%s: its multi-token prediction modules are not loaded (the model has no --mtp-num-layers)", ckpt)
    if ours and not stored:
        if not new_mtp:
            raise CheckpointError(
                f"{ckpt} holds no multi-token prediction modules but the model has them (--mtp-num-layers): drop the "
                "flag, or start a new pretraining run from it (--finetune), whose MTP modules start fresh")
        log.info("%s: no multi-token prediction modules; the model's start from their initial values", ckpt)
        return is_mtp_key if skip is None else (lambda k: skip(k) or is_mtp_key(k))
    return skip


def checkpoint_tokenizer(ckpt: Path, manifest: Optional[dict] = None) -> Optional[Path]:
    """``ckpt/tokenizer`` when the checkpoint has one and its files are intact; None when it has none (the caller
    then needs --tokenizer); a CheckpointError naming the damaged file otherwise."""
    ckpt = Path(ckpt)
    tokenizer = ckpt / "tokenizer"
    if not tokenizer.is_dir():
        return None
    manifest = manifest if manifest is not None else read_manifest(ckpt)
    found = integrity.problems(ckpt, manifest, integrity.select(manifest, ["tokenizer/"]))
    if found:
        raise CheckpointError(f"the tokenizer of checkpoint {ckpt} is damaged: {found[0]}; restore it, or remove "
                              f"{tokenizer} and pass --tokenizer with the model's tokenizer")
    return tokenizer
