"""Post-training quantization with NVIDIA ModelOpt: ``megapipe posttrain quantize``.

The checkpoint's model is calibrated with ``mtq.quantize(model, CONFIG, forward_loop)`` on batches cut from the
calibration data (a megapipe ``.bin/.idx`` prefix or a JSONL file), deterministically: the token stream of the
documents in order, cut into windows of ``seq_length`` tokens; the first ``calib_samples`` windows calibrate, the
next ``eval_iters x batch_size`` windows (or those of ``eval_data``) measure the perplexity before and after
(fake quantization). The result is a checkpoint in the shared format: the same weights (SmoothQuant/AWQ fold
their scales into them) plus the quantizer tensors in the DCP shards, and the ModelOpt state as JSON under
``quantization`` in the manifest (megapipe.checkpoint.quant_state, which also puts the quantizers back on load).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from megapipe.checkpoint import quant_state
from megapipe.errors import DataError, MegapipeError
from megapipe.fileio import refuse_overlap
from megapipe.models.capabilities import describe, require

Progress = Optional[Callable[[int, int], None]]
JSON_SUFFIXES = (".jsonl", ".json")

# --quant FORMAT -> the ModelOpt preset it applies (lm_head/`output.*` and embeddings are excluded by the presets)
FORMATS = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
}
KV_FORMATS = {"fp8": "FP8_KV_CFG"}
CUDA_ONLY = {"nvfp4": "ModelOpt's NVFP4 calibration runs CUDA kernels only"}


# --------------------------------------------------------------------------------------------------- config


def quantize_config(fmt: str, kv_cache: Optional[str] = None) -> dict:
    """The ModelOpt quantize config of ``--quant fmt [--kv-cache-quant kv]``: the preset, plus the KV entries."""
    import copy

    if fmt not in FORMATS:
        raise MegapipeError(f"--quant {fmt!r} is not a supported format (supported: {', '.join(FORMATS)})")
    if kv_cache is not None and kv_cache not in KV_FORMATS:
        raise MegapipeError(f"--kv-cache-quant {kv_cache!r} is not supported (supported: {', '.join(KV_FORMATS)})")
    module = quant_state.mtq()
    config = copy.deepcopy(getattr(module, FORMATS[fmt]))
    config["quant_cfg"] = list(config["quant_cfg"]) + copy.deepcopy(quant_state.UNQUANTIZED)
    if kv_cache is not None:
        config["quant_cfg"] += copy.deepcopy(getattr(module, KV_FORMATS[kv_cache])["quant_cfg"])
    return config


# --------------------------------------------------------------------------------------------------- data


def token_stream(source: str | Path, tokenizer, need: int, json_key: str = "text", option: str = "--calib-data"):
    """The first ``need`` tokens (or all, if fewer) of ``source``: a ``.bin/.idx`` prefix, or JSONL text."""
    from megapipe.data import indexed
    from megapipe.data.sidecar import check_data_tokenizer

    path = Path(source).expanduser()
    chunks, have = [], 0
    if indexed.exists(path):
        if tokenizer is not None:
            check_data_tokenizer([path], tokenizer, hint=f"or give {option} made with the checkpoint's tokenizer")
        data = indexed.IndexedDataset(path)
        for i in range(len(data)):
            chunks.append(np.asarray(data[i], dtype=np.int64))
            have += len(chunks[-1])
            if have >= need:
                break
    elif path.is_file() and path.suffix in JSON_SUFFIXES:
        if tokenizer is None:
            raise MegapipeError(f"{option} {source} is text: the checkpoint holds no tokenizer/ to tokenize it with")
        from megapipe.data.readers import iter_texts

        for text in iter_texts([path], json_key):
            ids = tokenizer.encode(text) + ([tokenizer.eod_id] if tokenizer.eod_id is not None else [])
            chunks.append(np.asarray(ids, dtype=np.int64))
            have += len(ids)
            if have >= need:
                break
    else:
        raise DataError(f"{option} {source}: neither {path}.bin/.idx (a megapipe data prefix) nor a JSONL file exists")
    stream = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    return torch.from_numpy(stream[:need].copy())


def windows(stream: torch.Tensor, count: int, seq_length: int, first: int = 0) -> torch.Tensor:
    """``count`` windows of ``seq_length + 1`` tokens, window i starting at token ``(first + i) * seq_length``."""
    starts = (first + torch.arange(count)) * seq_length
    if count == 0:
        return torch.zeros(0, seq_length + 1, dtype=stream.dtype)
    return torch.stack([stream[s : s + seq_length + 1] for s in starts.tolist()])


def _check_tokens(batch: torch.Tensor, vocab_size: int, where: str) -> None:
    top = int(batch.max())
    if top >= vocab_size:
        raise DataError(f"{where} holds token id {top} but the model has {vocab_size} ids: was it tokenized with "
                        "the checkpoint's tokenizer?")


# --------------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(logits_fn: Callable[[torch.Tensor], torch.Tensor], samples: torch.Tensor, batch_size: int,
             device="cpu") -> dict:
    """Mean next-token loss and perplexity of ``samples`` [N, S+1]; ``logits_fn(tokens [B, S]) -> [B, S, V]``."""
    total, count = 0.0, 0
    for i in range(0, len(samples), batch_size):
        batch = samples[i : i + batch_size].to(device)
        logits = logits_fn(batch[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += batch[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}


# --------------------------------------------------------------------------------------------------- quantizing


def calibrate(model: nn.Module, fmt: str, kv_cache: Optional[str], batches: torch.Tensor, batch_size: int,
              progress: Progress = None) -> nn.Module:
    """``mtq.quantize(model, CONFIG, forward_loop)`` over ``batches`` [N, S] (in place; returns the model; a
    megapipe model's MoE experts are first put in the layout ModelOpt quantizes: quant_state.prepare)."""
    mtq = quant_state.mtq()
    quant_state.prepare(model)
    config = quantize_config(fmt, kv_cache)
    device = next(model.parameters()).device
    steps = math.ceil(len(batches) / batch_size)
    done = [0]

    def forward_loop(m: nn.Module) -> None:
        for i in range(0, len(batches), batch_size):
            m(batches[i : i + batch_size].to(device))
            done[0] += 1
            if progress:
                progress(done[0], max(done[0], steps))

    with torch.no_grad(), quant_state.quiet():
        mtq.quantize(model, config, forward_loop)
    return model


def check_device(fmt: str, device: torch.device) -> None:
    if fmt in CUDA_ONLY and device.type != "cuda":
        raise MegapipeError(f"--quant {fmt} needs a CUDA GPU ({CUDA_ONLY[fmt]}); "
                            f"this run is on {device.type}: run it on a GPU machine or pick fp8, int8_sq, int4_awq or "
                            "w4a8_awq")


def quantize_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    fmt: str,
    calib_data: str | Path,
    kv_cache: Optional[str] = None,
    calib_samples: int = 512,
    seq_length: int = 512,
    batch_size: int = 4,
    eval_iters: int = 8,
    eval_data: Optional[str | Path] = None,
    json_key: str = "text",
    device: Optional[str] = None,
    overwrite: bool = False,
    progress: Progress = None,
) -> dict:
    """Quantize checkpoint ``ckpt`` into ``out``; returns a summary (perplexity before/after, times)."""
    from megapipe.checkpoint import read_manifest, resolve_checkpoint, write_checkpoint
    from megapipe.checkpoint.load import load_model, manifest_model_config
    from megapipe.dtypes import resolve_device

    started = time.perf_counter()
    ckpt, out = Path(ckpt).expanduser(), Path(out).expanduser()
    for name, value, low in (("--calib-samples", calib_samples, 1), ("--calib-seq-len", seq_length, 1),
                             ("--calib-batch-size", batch_size, 1), ("--eval-iters", eval_iters, 0)):
        if value < low:
            raise MegapipeError(f"{name} {value} is too small (at least {low})")
    device = resolve_device(device)
    given, ckpt = Path(ckpt).expanduser(), resolve_checkpoint(ckpt)
    refuse_overlap([out], [given, ckpt])  # before --overwrite: no output may replace or sit inside what it reads
    if out.exists() and not overwrite:
        raise MegapipeError(f"{out} already exists: pick another output or pass --overwrite")
    # bad names, then a missing ModelOpt, before any work; after the paths, which need no minute of importing it
    quantize_config(fmt, kv_cache)
    check_device(fmt, device)
    manifest = read_manifest(ckpt)
    if manifest.get("quantization"):
        raise MegapipeError(f"{ckpt} is already quantized ({manifest['quantization'].get('format')}): quantize its "
                            f"unquantized parent instead ({manifest.get('parent')})")
    model_cfg = manifest.get("model") or {}
    cfg = manifest_model_config(ckpt, manifest)
    require(cfg, "quantize", str(ckpt), quant=fmt)
    if kv_cache is not None and cfg.multi_latent_attention:
        raise MegapipeError(f"{ckpt}: --kv-cache-quant {kv_cache}: {describe(cfg)} models cache multi-latent "
                            "attention's compressed latent, which the KV cache quantizers (on each head's keys and "
                            "values) do not reach: quantize without --kv-cache-quant")
    if seq_length > int(model_cfg.get("max_position_embeddings", seq_length)):
        raise MegapipeError(f"--calib-seq-len {seq_length} exceeds the model's max_position_embeddings "
                            f"({model_cfg['max_position_embeddings']})")

    loaded = load_model(ckpt, device=device)
    model, manifest, tok_dir, tokenizer = loaded.model, loaded.manifest, loaded.tokenizer_dir, loaded.tokenizer
    vocab = model.cfg.vocab_size
    n_eval = eval_iters * batch_size
    held_out = eval_data is None
    need = (calib_samples + (n_eval if held_out else 0)) * seq_length + 1
    stream = token_stream(calib_data, tokenizer, need, json_key)
    if len(stream) < need:
        extra = f" + {n_eval} evaluation windows (--eval-iters x --calib-batch-size)" if held_out and n_eval else ""
        raise DataError(f"--calib-data {calib_data} holds {len(stream)} tokens, fewer than the {need} that "
                        f"{calib_samples} calibration windows of {seq_length} tokens{extra} need: lower "
                        "--calib-samples/--calib-seq-len/--eval-iters or give more data")
    calib = windows(stream, calib_samples, seq_length)[:, :-1]
    _check_tokens(calib, vocab, f"--calib-data {calib_data}")
    if held_out:
        evals = windows(stream, n_eval, seq_length, first=calib_samples)
    else:
        evals_stream = token_stream(eval_data, tokenizer, n_eval * seq_length + 1, json_key, "--eval-data")
        if len(evals_stream) < n_eval * seq_length + 1 and n_eval:
            raise DataError(f"--eval-data {eval_data} holds {len(evals_stream)} tokens, fewer than the "
                            f"{n_eval * seq_length + 1} that {n_eval} windows of {seq_length} tokens need")
        evals = windows(evals_stream, n_eval, seq_length)
    if n_eval:
        _check_tokens(evals, vocab, f"--eval-data {eval_data or calib_data}")

    before = evaluate(model, evals, batch_size, device) if n_eval else None
    t0 = time.perf_counter()
    calibrate(model, fmt, kv_cache, calib, batch_size, progress)
    calib_seconds = time.perf_counter() - t0
    after = evaluate(model, evals, batch_size, device) if n_eval else None

    quantization = {
        "format": fmt,
        "kv_cache": kv_cache,
        "tool": f"nvidia-modelopt {quant_state.modelopt_version()}",
        "calibration": {"data": str(Path(calib_data).expanduser().absolute()), "samples": calib_samples,
                        "seq_length": seq_length, "batch_size": batch_size, "seconds": round(calib_seconds, 3)},
        "evaluation": {"data": str(Path(eval_data or calib_data).expanduser().absolute()),
                       "held_out_of_calibration_data": held_out, "before": before, "after": after},
        "modelopt": quant_state.export_state(model),
    }
    fields = {k: manifest.get(k) for k in ("model", "hf", "tokens_seen") if manifest.get(k) is not None}
    fields.update(stage="quantize", parent=str(ckpt), quantization=quantization)
    write_checkpoint(out, model, step=int(manifest.get("step") or 0), manifest=fields,
                     tokenizer=tok_dir if tok_dir is not None else None)
    summary = {"checkpoint": str(out), "format": fmt + (f" + kv {kv_cache}" if kv_cache else ""),
               "calibration": f"{calib_samples} x {seq_length} tokens", "calibration_seconds": calib_seconds}
    if n_eval:
        change = after["perplexity"] / before["perplexity"] - 1
        summary.update(eval_tokens=before["tokens"], perplexity_before=before["perplexity"],
                       perplexity_after=after["perplexity"], perplexity_change=change)
    summary["seconds"] = time.perf_counter() - started
    return summary
