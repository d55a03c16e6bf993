"""Structured pruning, Minitron-style (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge
Distillation"): importance from forward passes over calibration data only, then a smaller model of the same family
whose weights are slices of the original's.

Importance, each aggregated as the mean over a sample's tokens, then the L2 norm over samples:

- FFN neurons: |activation| of the intermediate (the input of ``w2``: silu(w1 x) * w3 x, or gelu(w1 x));
- attention heads: the L2 norm of each head's contribution to the residual stream (its attention output through
  its columns of ``wo``; the output alone, Minitron's measure, ignores how much ``wo`` passes on, and chose worse
  KV groups than random on the test model); a KV group's importance is the sum of its query heads'. GQA-aware: KV groups are kept by group importance, then within each
  kept group the same number of query heads by head importance, so every group keeps a regular query count;
- embedding channels: |output| of every norm (each block's two and the final one), summed;
- KV groups (``group_metric``, when their number is pruned): ``loss`` (the default) = the calibration loss increase
  when the group's heads output zeros (layers x groups more passes; on the test model the summed head norms kept
  worse groups than random draws did), or ``norm`` = the sum of its query heads' importance;
- layers (``depth_metric``): ``bi`` = block importance, 1 - mean cos(input, output) of the block (ShortGPT /
  Minitron), or ``loss`` = the calibration loss increase when the block is skipped.

Kept indices stay in their original order; head_dim is unchanged (it becomes explicit in the config when the new
hidden size / heads no longer imply it). ``importance="random"`` draws the same shape at random (the baseline
importance is measured against). Several processes (torchrun) split the calibration and validation samples and
sum their statistics, which gives the single-process result.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from megapipe.checkpoint import read_manifest, resolve_checkpoint, write_checkpoint
from megapipe.checkpoint.hf.base import adapter_for_arch
from megapipe.checkpoint.load import load_model, manifest_model_config
from megapipe.config import ModelConfig
from megapipe.data.gpt_dataset import build_gpt_datasets
from megapipe.data.indexed import exists
from megapipe.data.sft import ChatEncoder
from megapipe.data.sft_dataset import build_sft_datasets, prepare_sft_index
from megapipe.data.sidecar import check_data_tokenizer
from megapipe.data.tokenizer import load_tokenizer
from megapipe.errors import CheckpointError, ConfigError, MegapipeError
from megapipe.fileio import refuse_overlap
from megapipe.models import build_model, count_params
from megapipe.models.capabilities import require
from megapipe.models.objective import IGNORE_INDEX, loss_targets
from megapipe.parallel.step import model_kwargs
from megapipe.posttrain.start import quantized_from

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "num_layers")
FLAGS = {"hidden_size": "--hidden", "intermediate_size": "--ffn", "num_heads": "--heads", "num_kv_heads": "--kv-heads",
         "num_layers": "--layers"}


@dataclass
class PruneTargets:
    hidden: Optional[int] = None
    ffn: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    layers: Optional[int] = None
    target_params: Optional[float] = None  # a fraction (<= 1) of the parameters, or a count

    def given(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))


def param_count(cfg: ModelConfig) -> int:
    return count_params(build_model(cfg, device="meta"))


# --------------------------------------------------------------------------------------------------- the shape


def _check_range(flag: str, value: int, limit: int, what: str) -> None:
    if value < 1:
        raise ConfigError(f"{flag} {value} must be >= 1")
    if value > limit:
        raise ConfigError(f"{flag} {value} is more than the model has ({what} = {limit}): pruning only removes, never adds")


def plan_shape(cfg: ModelConfig, t: PruneTargets) -> ModelConfig:
    """The pruned model's config for ``t``; impossible targets raise a ConfigError naming the flag and the limit."""
    if not t.given():
        raise ConfigError("give a target: --target-params FRACTION|COUNT, or --hidden / --ffn / --heads / "
                          "--kv-heads / --layers")
    if t.target_params is not None and (t.hidden is not None or t.ffn is not None):
        raise ConfigError("--target-params chooses --hidden and --ffn itself: give one or the other")
    heads, kv = cfg.num_heads, cfg.kv_heads
    for flag, value, limit, what in (("--hidden", t.hidden, cfg.hidden_size, "hidden_size"),
                                     ("--ffn", t.ffn, cfg.intermediate_size, "intermediate_size"),
                                     ("--heads", t.heads, heads, "num_heads"),
                                     ("--kv-heads", t.kv_heads, kv, "num_kv_heads"),
                                     ("--layers", t.layers, cfg.num_layers, "num_layers")):
        if value is not None:
            _check_range(flag, value, limit, what)
    new_heads = t.heads if t.heads is not None else heads
    new_kv = t.kv_heads if t.kv_heads is not None else min(kv, new_heads)
    if t.kv_heads is None and kv < heads and new_heads % kv:  # without --kv-heads a GQA model's KV groups stay
        raise ConfigError(f"--heads {new_heads} is not a multiple of the model's {kv} KV groups (num_kv_heads): query "
                          "heads are pruned per KV group and every group keeps the same number; give --kv-heads to "
                          "prune KV groups too")
    if new_heads % new_kv:
        raise ConfigError(f"--heads {new_heads} is not a multiple of --kv-heads {new_kv}: query heads are pruned per "
                          "KV group and every group keeps the same number")
    if new_heads // new_kv > heads // kv:
        raise ConfigError(f"--heads {new_heads} with --kv-heads {new_kv} needs {new_heads // new_kv} query heads per KV "
                          f"group, but each group has {heads // kv}")
    new = dataclasses.replace(
        cfg, preset=None, num_heads=new_heads, num_kv_heads=new_kv if new_kv != new_heads or cfg.num_kv_heads else None,
        num_layers=t.layers if t.layers is not None else cfg.num_layers,
        hidden_size=t.hidden if t.hidden is not None else cfg.hidden_size,
        intermediate_size=t.ffn if t.ffn is not None else cfg.intermediate_size,
    )
    if t.target_params is not None:
        new = _fit_params(cfg, new, t.target_params)
    new = _keep_head_dim(cfg, new)
    _check_expressible(cfg, new, t)
    return new


def _keep_head_dim(old: ModelConfig, new: ModelConfig) -> ModelConfig:
    """Pruning never changes the size of a head: make head_dim explicit when hidden / heads stops implying it."""
    hd = old.dim_per_head
    if new.hidden_size % new.num_heads == 0 and new.hidden_size // new.num_heads == hd:
        return dataclasses.replace(new, head_dim=old.head_dim)
    return dataclasses.replace(new, head_dim=hd)


def _check_expressible(old: ModelConfig, new: ModelConfig, t: PruneTargets) -> None:
    """The architecture's own head_dim rule (GPT-2: head_dim = hidden / heads) must still hold."""
    try:
        adapter = adapter_for_arch(new.arch)
    except MegapipeError:
        return
    try:
        adapter.hf_config(new)
    except ConfigError as e:
        asked = " ".join(f"{FLAGS[f]} {getattr(new, f)}" for f in ("hidden_size", "num_heads"))
        raise ConfigError(f"{asked}: a {new.arch} model keeps head_dim = hidden_size / num_heads = "
                          f"{old.dim_per_head}, which these do not ({e})") from None


def _fit_params(old: ModelConfig, shape: ModelConfig, target: float) -> ModelConfig:
    """Width-first (Minitron's advice): scale hidden and FFN sizes by one factor, the largest whose model has at
    most ``target`` parameters (a fraction of the original's when <= 1)."""
    total = param_count(old)
    if not math.isfinite(target) or target <= 0:
        raise ConfigError(f"--target-params {target:g} must be a finite fraction in (0, 1) or a parameter count")
    want = int(target * total) if target <= 1 else int(target)
    if want >= total:
        raise ConfigError(f"--target-params {target:g} must be below the model's {total:,} parameters (a fraction in "
                          "(0, 1) or a smaller count)")

    def at(s: float) -> ModelConfig:
        def size(n: int) -> int:
            m = 8 if n % 8 == 0 and n >= 64 else 1
            return max(m, int(n * s) // m * m)
        return _keep_head_dim(old, dataclasses.replace(shape, hidden_size=size(old.hidden_size),
                                                       intermediate_size=size(old.intermediate_size)))

    if param_count(at(0.0)) > want:
        raise ConfigError(f"--target-params {target:g} ({want:,} parameters) cannot be reached by narrowing hidden and "
                          f"FFN sizes alone (the smallest gives {param_count(at(0.0)):,}); also prune --layers or "
                          "--heads")
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if param_count(at(mid)) <= want else (lo, mid)
    return at(lo)


# --------------------------------------------------------------------------------------------------- importance


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


class _Stats:
    """Sums of squares over samples of per-sample token means, for each scored unit (and BI sums)."""

    def __init__(self, cfg: ModelConfig):
        L = cfg.num_layers
        self.ffn = torch.zeros(L, cfg.intermediate_size, dtype=torch.float64)
        self.heads = torch.zeros(L, cfg.num_heads, dtype=torch.float64)
        self.hidden = torch.zeros(cfg.hidden_size, dtype=torch.float64)
        self.bi = torch.zeros(L, dtype=torch.float64)
        self.tokens = torch.zeros((), dtype=torch.float64)

    def reduce(self) -> None:
        for name in ("ffn", "heads", "hidden", "bi", "tokens"):
            setattr(self, name, _all_reduce(getattr(self, name)))


def _sample_mean_sq(x: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> sum over samples of (mean over tokens)^2, [...]."""
    return x.double().mean(dim=1).pow(2).sum(dim=0)


def _hooks(model: nn.Module, stats: _Stats, head_dim: int) -> list:
    handles = []

    def on(module, fn, pre: bool):
        handles.append(module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn))

    def norm_out(_m, _args, out):
        stats.hidden.add_(_sample_mean_sq(out.detach().abs()))

    for i, block in enumerate(model.layers.values()):
        def ffn(_m, args, i=i):
            stats.ffn[i] += _sample_mean_sq(args[0].detach().abs())

        def heads(wo, args, i=i):
            # each head's contribution to the residual stream: its output through its columns of wo
            x = args[0].detach().float()
            b, s, _ = x.shape
            per_head = x.view(b, s, -1, 1, head_dim)  # [B, S, heads, 1, hd]
            w = wo.weight.detach().float().view(wo.weight.shape[0], -1, head_dim).transpose(0, 1)  # [heads, H, hd]
            out = (per_head @ w.transpose(1, 2).unsqueeze(0).unsqueeze(0)).squeeze(-2)  # [B, S, heads, H]
            stats.heads[i] += _sample_mean_sq(out.norm(dim=-1))

        def bi(_m, args, out, i=i):
            cos = nn.functional.cosine_similarity(args[0].detach().double(), out.detach().double(), dim=-1)
            stats.bi[i] += (1 - cos).sum()

        on(block.feed_forward.w2, ffn, pre=True)
        on(block.attention.wo, heads, pre=True)
        on(block.attention_norm, norm_out, pre=False)
        on(block.ffn_norm, norm_out, pre=False)
        handles.append(block.register_forward_hook(bi))
    if model.norm is not None:
        on(model.norm, norm_out, pre=False)
    return handles


@dataclass
class Importance:
    ffn: torch.Tensor  # [L, F]
    heads: torch.Tensor  # [L, heads]
    hidden: torch.Tensor  # [H]
    layers: torch.Tensor  # [L]: higher = more important
    depth_metric: str
    groups: Optional[torch.Tensor] = None  # [L, kv_heads] (group_metric "loss"); None: the sum of its heads'


def _forward(model, batch):
    return model(batch["tokens"], **model_kwargs(batch))


@torch.no_grad()
def compute_importance(model: nn.Module, batches: list[dict], depth_metric: str = "bi",
                       group_metric: str = "norm") -> Importance:
    """Forward passes over ``batches`` (this rank's share) with hooks; statistics summed over ranks.
    ``group_metric="loss"``: a KV group's importance is the loss increase when its heads' outputs are zeroed
    (layers x groups more passes) instead of the sum of its heads' norms."""
    cfg = model.cfg
    stats = _Stats(cfg)
    handles = _hooks(model, stats, cfg.dim_per_head)
    try:
        for b in batches:
            _forward(model, b)
            stats.tokens += b["tokens"].numel()
    finally:
        for h in handles:
            h.remove()
    stats.reduce()
    if depth_metric == "bi":
        layers = stats.bi / stats.tokens.clamp(min=1)
    elif depth_metric == "loss":
        base = loss_of(model, batches)
        layers = torch.zeros(cfg.num_layers, dtype=torch.float64)
        for i, key in enumerate(list(model.layers)):
            block = model.layers[key]
            model.layers[key] = _Skip()
            try:
                layers[i] = loss_of(model, batches) - base
            finally:
                model.layers[key] = block
    else:
        raise ConfigError(f"--depth-metric {depth_metric!r} is not one of bi, loss")
    groups = None
    if group_metric == "loss":
        groups = _group_losses(model, batches)
    elif group_metric != "norm":
        raise ConfigError(f"--group-metric {group_metric!r} is not one of norm, loss")
    return Importance(stats.ffn.sqrt(), stats.heads.sqrt(), stats.hidden.sqrt(), layers, depth_metric, groups)


def _group_losses(model: nn.Module, batches: list[dict]) -> torch.Tensor:
    """[L, kv_heads]: the calibration loss increase when one KV group's heads output zeros."""
    cfg = model.cfg
    hd, per_group = cfg.dim_per_head, cfg.num_heads // cfg.kv_heads
    base = loss_of(model, batches)
    out = torch.zeros(cfg.num_layers, cfg.kv_heads, dtype=torch.float64)
    for i, block in enumerate(model.layers.values()):
        for g in range(cfg.kv_heads):
            cols = slice(g * per_group * hd, (g + 1) * per_group * hd)

            def zero(_m, args, cols=cols):
                x = args[0].clone()
                x[..., cols] = 0
                return (x, *args[1:])

            handle = block.attention.wo.register_forward_pre_hook(zero)
            try:
                out[i, g] = loss_of(model, batches) - base
            finally:
                handle.remove()
    return out


class _Skip(nn.Module):
    def forward(self, x, *args, **kwargs):
        return x


@torch.no_grad()
def loss_of(model: nn.Module, batches: list[dict]) -> float:
    """Token-weighted next-token cross-entropy over ``batches`` (loss_mask honoured), summed over ranks."""
    sums = torch.zeros(2, dtype=torch.float64)
    for b in batches:
        logits = _forward(model, b).float()
        targets = loss_targets(b)
        sums[0] += nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                               reduction="sum").double()
        sums[1] += (targets != IGNORE_INDEX).sum()
    _all_reduce(sums)
    return float(sums[0] / sums[1]) if sums[1] else float("nan")


# --------------------------------------------------------------------------------------------------- selection


@dataclass
class Keep:
    """Indices kept, in the original order: layers, hidden channels, and per kept layer FFN neurons, query heads
    (grouped by KV group) and KV groups."""

    layers: list[int]
    hidden: torch.Tensor
    ffn: list[torch.Tensor]
    heads: list[torch.Tensor]
    kv: list[torch.Tensor]


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.topk(k).indices.sort().values


def select(imp: Optional[Importance], old: ModelConfig, new: ModelConfig, method: str = "activation",
           seed: int = 0) -> Keep:
    """Which units to keep: the most important (``activation``), or the same counts at random (``random``)."""
    g = torch.Generator().manual_seed(seed)
    L, H, F, N, K = old.num_layers, old.hidden_size, old.intermediate_size, old.num_heads, old.kv_heads
    if method == "random":
        imp = Importance(torch.rand(L, F, generator=g), torch.rand(L, N, generator=g), torch.rand(H, generator=g),
                         torch.rand(L, generator=g), "random")
    elif method != "activation":
        raise ConfigError(f"--importance {method!r} is not one of activation, random")
    layers = _top(imp.layers, new.num_layers).tolist()
    per_group, new_per_group = N // K, new.num_heads // new.kv_heads
    ffn, heads, kv = [], [], []
    for i in layers:
        ffn.append(_top(imp.ffn[i], new.intermediate_size))
        group_scores = imp.groups[i] if imp.groups is not None else imp.heads[i].view(K, per_group).sum(-1)
        groups = _top(group_scores, new.kv_heads)
        kept = [g * per_group + _top(imp.heads[i][g * per_group:(g + 1) * per_group], new_per_group)
                for g in groups.tolist()]
        heads.append(torch.cat(kept))
        kv.append(groups)
    return Keep(layers, _top(imp.hidden, new.hidden_size), ffn, heads, kv)


# --------------------------------------------------------------------------------------------------- slicing


def _rows(idx: torch.Tensor, size: int) -> torch.Tensor:
    """Head indices -> the rows of their ``size``-wide blocks."""
    return (idx[:, None] * size + torch.arange(size)[None]).flatten()


@torch.no_grad()
def slice_model(model: nn.Module, new_cfg: ModelConfig, keep: Keep) -> nn.Module:
    """A new model of ``new_cfg`` holding the kept slices of ``model``'s weights (same device and dtype)."""
    p = next(model.parameters())
    new = build_model(new_cfg, device="meta").to_empty(device=p.device).to(p.dtype)
    old_state, h, hd = model.state_dict(), keep.hidden, model.cfg.dim_per_head
    for name, target in new.state_dict().items():
        parts = name.split(".")
        if parts[0] == "layers":
            j = int(parts[1])
            src = f"layers.{keep.layers[j]}." + ".".join(parts[2:])
            value = _slice_block(".".join(parts[2:]), old_state[src], h, keep.ffn[j], _rows(keep.heads[j], hd),
                                 _rows(keep.kv[j], hd))
        elif parts[0] in ("tok_embeddings", "pos_embeddings", "output"):
            value = old_state[name][:, h]
        elif parts[0] == "norm":
            value = old_state[name][h]
        else:
            raise KeyError(f"no pruning rule for {name}")
        if tuple(value.shape) != tuple(target.shape):
            raise RuntimeError(f"pruning {name}: got {tuple(value.shape)}, the new model has {tuple(target.shape)}")
        target.copy_(value)
    return new


def _slice_block(name: str, w: torch.Tensor, h, f, q_rows, kv_rows) -> torch.Tensor:
    module, kind = name.rsplit(".", 1)
    if module in ("attention_norm", "ffn_norm"):
        return w[h]
    if module in ("attention.q_norm", "attention.k_norm"):
        return w
    rows_cols = {
        "attention.wq": (q_rows, h), "attention.wk": (kv_rows, h), "attention.wv": (kv_rows, h),
        "attention.wo": (h, q_rows), "feed_forward.w1": (f, h), "feed_forward.w3": (f, h),
        "feed_forward.w2": (h, f),
    }
    if module not in rows_cols:
        raise KeyError(f"no pruning rule for {name}")
    rows, cols = rows_cols[module]
    return w[rows][:, cols] if kind == "weight" else w[rows]


def prune_model(model: nn.Module, new_cfg: ModelConfig, calib: Iterable[dict], depth_metric: str = "bi",
                method: str = "activation", seed: int = 0,
                group_metric: str = "norm") -> tuple[nn.Module, Optional[Importance], Keep]:
    """Importance (unless random) -> selection -> the pruned model. The loss-based metrics only run when their
    dimension is pruned."""
    old = model.cfg
    depth = depth_metric if new_cfg.num_layers < old.num_layers else "bi"
    groups = group_metric if new_cfg.kv_heads < old.kv_heads else "norm"
    imp = compute_importance(model, list(calib), depth, groups) if method == "activation" else None
    keep = select(imp, model.cfg, new_cfg, method, seed)
    return slice_model(model, new_cfg, keep), imp, keep


def describe_shape(cfg: ModelConfig) -> str:
    return (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, ffn {cfg.intermediate_size}, heads {cfg.num_heads}"
            f" (kv {cfg.kv_heads}, head_dim {cfg.dim_per_head})")


def ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))


# --------------------------------------------------------------------------------------------------- data


def prune_batches(data: str, ckpt_tokenizer, seq_length: int, calib_samples: int, valid_samples: int,
                  micro_batch_size: int, split: str, seed: int, cache_dir: Optional[str] = None,
                  chat_template: Optional[str] = None) -> tuple[list[dict], list[dict]]:
    """(calibration, validation) micro-batches of this rank's share: from a .bin/.idx prefix (the train and valid
    splits of GPT samples) or SFT records (packed conversations; validation on their trained tokens)."""
    import numpy as np

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    wanted = {"train": calib_samples, "valid": valid_samples}
    if exists(data):
        if ckpt_tokenizer is not None:
            check_data_tokenizer([data], load_tokenizer(ckpt_tokenizer),
                                 hint="or give --calib-data made with the checkpoint's tokenizer")
        ds = build_gpt_datasets([data], split, seq_length, wanted, seed, cache_dir)

        def sample(d, i):
            s = np.asarray(d[i], dtype=np.int64)
            return {"tokens": s[:-1], "labels": s[1:]}
    else:
        if ckpt_tokenizer is None:
            raise ConfigError(f"--calib-data {data} is not a .bin/.idx prefix, and records need the checkpoint's "
                              "tokenizer, which it does not hold")

        encoder = ChatEncoder(ckpt_tokenizer, chat_template)
        index = prepare_sft_index([data], encoder, cache_dir=cache_dir)
        ds = build_sft_datasets(index, split, seq_length, wanted, seed, True, "truncate",
                                load_tokenizer(ckpt_tokenizer).pad_id)

        def sample(d, i):
            return d[i]

    def batches(name: str, count: int) -> list[dict]:
        d = ds.get(name)
        if d is None or not count:
            return []
        mine = [i for i in range(count) if i % world == rank]
        out = []
        for s in range(0, len(mine), micro_batch_size):
            rows = [sample(d, i) for i in mine[s:s + micro_batch_size]]
            out.append({k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]})
        return out

    return batches("train", calib_samples), batches("valid", valid_samples)


# --------------------------------------------------------------------------------------------------- the stage


def prune_checkpoint(ckpt, output, targets: PruneTargets, calib_data: str, calib_samples: int = 256,
                     valid_samples: int = 64, seq_length: int = 512, micro_batch_size: int = 8,
                     split: str = "969,30,1", depth_metric: str = "bi", importance: str = "activation",
                     seed: int = 1234, overwrite: bool = False, cache_dir: Optional[str] = None,
                     chat_template: Optional[str] = None, group_metric: str = "loss") -> dict:
    """Prune checkpoint ``ckpt`` to ``targets`` and write the result at ``output`` (stage ``prune``, parent
    ``ckpt``); returns the summary: shapes, parameters and validation loss before and after."""
    from pathlib import Path

    given, output = Path(ckpt).expanduser(), Path(output).expanduser()
    ckpt = resolve_checkpoint(given)
    refuse_overlap([output], [given, ckpt], CheckpointError)
    quantized = quantized_from(ckpt, read_manifest(ckpt))
    if quantized is not None:  # the pruned weights would lose their quantizers: prune first, then quantize
        fmt, origin = quantized
        raise CheckpointError(f"{ckpt} is quantized ({fmt}): pruning would drop its quantization; prune {origin}, "
                              "then quantize the pruned one")
    if output.exists() and not overwrite:
        raise CheckpointError(f"{output} already exists: pick another --output or pass --overwrite")
    if depth_metric not in ("bi", "loss"):
        raise ConfigError(f"--depth-metric {depth_metric!r} is not one of bi, loss")
    if group_metric not in ("norm", "loss"):
        raise ConfigError(f"--group-metric {group_metric!r} is not one of norm, loss")
    if importance not in ("activation", "random"):
        raise ConfigError(f"--importance {importance!r} is not one of activation, random")
    for flag, value in (("--calib-samples", calib_samples), ("--valid-samples", valid_samples),
                        ("--seq-length", seq_length), ("--micro-batch-size", micro_batch_size)):
        if value < 1:  # the validation loss before and after is what prune reports
            raise ConfigError(f"{flag} {value} must be >= 1")
    cfg = manifest_model_config(ckpt)
    require(cfg, "prune", str(ckpt))  # before any work: the architecture's row says whether it can be pruned
    if seq_length > cfg.max_position_embeddings:
        raise ConfigError(f"--seq-length {seq_length} is longer than the model's max_position_embeddings = "
                          f"{cfg.max_position_embeddings}")
    new_cfg = plan_shape(cfg, targets)
    loaded = load_model(ckpt)
    model, manifest, tokenizer = loaded.model, loaded.manifest, loaded.tokenizer_dir
    calib, valid = prune_batches(calib_data, tokenizer, seq_length, calib_samples, valid_samples, micro_batch_size,
                                 split, seed, cache_dir, chat_template)
    before = loss_of(model, valid)
    pruned, _, keep = prune_model(model, new_cfg, calib, depth_metric, importance, seed, group_metric)
    after = loss_of(pruned, valid)
    summary = {
        "input": str(ckpt), "output": str(output.absolute()),
        "shape_before": describe_shape(cfg), "shape_after": describe_shape(new_cfg),
        "parameters_before": param_count(cfg), "parameters_after": param_count(new_cfg),
        "valid_loss_before": before, "valid_loss_after": after,
        "importance": importance, "depth_metric": depth_metric, "group_metric": group_metric,
        "calib_samples": calib_samples,
        "layers_kept": keep.layers,
    }
    fields = {"model": new_cfg, "stage": "prune", "parent": str(ckpt),
              "prune": {k: v for k, v in summary.items() if k not in ("input", "output")}}
    if isinstance(manifest.get("hf"), dict):
        fields["hf"] = manifest["hf"]
    write_checkpoint(output, pruned, step=0, manifest=fields, tokenizer=tokenizer)
    return summary
