"""The parallel layout: dp_replicate x dp_shard x cp x tp x pp, validated before anything starts, and its DeviceMesh.

Mesh dimension order (outermost first) is pp, dp_replicate, dp_shard, cp, tp, as in torchtitan: TP ranks are
neighbours (fastest links), PP ranks are furthest apart. Flattened views: "dp" (dp_replicate x dp_shard: ranks
that see different data), "dp_shard_cp" (the FSDP sharding group: CP ranks hold the same weights, so they shard
them too) and "dp_cp" (ranks whose losses/gradients are averaged).

Expert parallelism borrows from dp_shard: with ep > 1, dp_shard is split into "edp" (dp_shard / ep) and "ep"
(placed inside cp, next to tp): the MoE layers' experts are sharded over "ep" (tokens travel by all-to-all) and
FSDP-sharded over "edp_cp" (edp x cp; "ehsdp" adds dp_replicate), while everything else is sharded as without EP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megapipe.config import ModelConfig, ParallelConfig, TrainConfig
from megapipe.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_DIMS = ("pp", "dp_replicate", "edp", "cp", "ep", "tp")
SCHEDULE_STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": None, "ZBVZeroBubble": 2, "DualPipeV": 2}


_MESHES: dict = {}  # (device type, dims, sizes) -> (default process group, world mesh, named meshes)


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism, within dp_shard (not a factor of the world size)
    world_size: int = 1
    dp_mode: str = "fsdp"  # "fsdp" (FSDP2 / HSDP) or "ddp" (replication only)
    sequence_parallel: bool = True
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1
    pp_layer_split: Optional[list[int]] = None
    pp_microbatches: Optional[int] = None
    fsdp_reshard_after_forward: bool = True
    world_mesh: Any = field(default=None, repr=False)
    meshes: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------------------------------- construction

    @classmethod
    def from_config(cls, pcfg: ParallelConfig, world_size: int, train_cfg: Optional[TrainConfig] = None,
                    model_cfg: Optional[ModelConfig] = None, seq_length: Optional[int] = None,
                    packed: bool = False) -> "ParallelDims":
        """Resolve ``dp_shard=-1`` and refuse impossible layouts with one sentence naming the key and the limit.
        ``packed``: batches carry document ids / position ids (packed sequences)."""
        tp, pp, cp, rep = pcfg.tp, pcfg.pp, pcfg.cp, pcfg.dp_replicate
        for name in ("tp", "pp", "cp", "dp_replicate"):
            if getattr(pcfg, name) < 1:
                raise ConfigError(f"parallel.{name} = {getattr(pcfg, name)} must be >= 1")
        others = tp * pp * cp * rep
        shard = pcfg.dp_shard
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by tp*pp*cp*dp_replicate = "
                    f"{tp}*{pp}*{cp}*{rep} = {others}, so parallel.dp_shard = -1 cannot fill the rest"
                )
            shard = world_size // others
        elif shard < 1:
            raise ConfigError(f"parallel.dp_shard = {shard} must be >= 1, or -1 for the rest of the world size")
        if others * shard != world_size:
            raise ConfigError(
                f"layout dp_replicate*dp_shard*cp*tp*pp = {rep}*{shard}*{cp}*{tp}*{pp} = {others * shard} "
                f"does not match the world size {world_size}"
            )
        if pcfg.dp_mode == "ddp":  # DDP replicates: all data-parallel ranks are replicas
            if tp > 1 or pp > 1:
                raise ConfigError(
                    f"parallel.dp_mode = 'ddp' combines with data and context parallelism only (tp = {tp}, pp = {pp}); "
                    "use dp_mode 'fsdp' (fsdp_reshard_after_forward=false is Megatron's distributed optimizer)"
                )
            rep, shard = rep * shard, 1
        dims = cls(
            dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=pcfg.ep, world_size=world_size,
            dp_mode=pcfg.dp_mode,
            sequence_parallel=pcfg.sequence_parallel, pp_schedule=pcfg.pp_schedule,
            pp_virtual_stages=pcfg.pp_virtual_stages, pp_layer_split=pcfg.pp_layer_split,
            pp_microbatches=pcfg.pp_microbatches, fsdp_reshard_after_forward=pcfg.fsdp_reshard_after_forward,
        )
        dims._validate_pp()
        if packed and (pp > 1 or cp > 1):
            raise ConfigError(
                f"packed sequences (document-bounded attention or per-document positions) are not supported with "
                f"parallel.pp = {pp} / parallel.cp = {cp} yet (ring attention and pipeline stages do not carry "
                "document ids); use data, tensor or sequence parallelism"
            )
        dims._validate_ep(model_cfg, train_cfg)
        if model_cfg is not None:
            dims._validate_model(model_cfg)
        if seq_length is not None:
            dims._validate_seq(seq_length)
        if model_cfg is not None:
            dims._validate_hash_layers(model_cfg, seq_length)
        if train_cfg is not None:
            dims._validate_train(train_cfg)
        return dims

    def _validate_pp(self) -> None:
        v, sched = self.pp_virtual_stages, self.pp_schedule
        need = SCHEDULE_STAGES_PER_RANK[sched]
        if self.pp > 1:
            if need is not None and v != need:
                raise ConfigError(
                    f"parallel.pp_schedule = {sched!r} runs {need} stage(s) per rank, "
                    f"but parallel.pp_virtual_stages = {v}"
                )
            if need is None and v < 2:
                raise ConfigError(
                    f"parallel.pp_schedule = {sched!r} needs parallel.pp_virtual_stages >= 2 (got {v}); "
                    "use '1F1B' for one stage per rank"
                )
        elif v != 1:
            raise ConfigError(f"parallel.pp_virtual_stages = {v} needs parallel.pp > 1")

    def _validate_ep(self, m, t) -> None:
        """Expert parallelism: the supported combinations (refused here, before anything starts, otherwise)."""
        ep = self.ep
        if ep < 1:
            raise ConfigError(f"parallel.ep = {ep} must be >= 1")
        if ep == 1:
            return
        if m is not None and not m.is_moe:
            raise ConfigError(f"parallel.ep = {ep} needs an MoE model (model.num_experts > 0, e.g. --num-experts 8)")
        if self.dp_mode != "fsdp":
            raise ConfigError(
                f"parallel.ep = {ep} needs parallel.dp_mode = 'fsdp' (expert parallelism borrows from the FSDP ranks)")
        if self.dp_shard % ep:
            raise ConfigError(
                f"parallel.ep = {ep} must divide parallel.dp_shard = {self.dp_shard} (expert parallelism borrows from "
                "the FSDP ranks; with tp/pp/cp the rest of the world is dp_shard)")
        if m is not None and m.num_experts % ep:
            raise ConfigError(f"model.num_experts = {m.num_experts} is not divisible by parallel.ep = {ep}")
        if t is not None and t.compile:
            raise ConfigError(
                f"train.compile = true is not supported with parallel.ep = {ep} (the token all-to-all has "
                "data-dependent shapes)")

    def _validate_model(self, m) -> None:
        tp = self.tp
        if tp > 1:
            kinds = m.layer_kinds or "*-"  # a hybrid model: only what its layers split (MoE layers stay whole)
            split = ([("num_heads", m.num_heads), ("num_kv_heads", m.kv_heads)] if "*" in kinds else []) + (
                [("intermediate_size", m.intermediate_size)] if "-" in kinds else []) + (
                [("mamba_num_heads", m.mamba_heads), ("mamba_num_groups", m.mamba_num_groups)] if "M" in kinds else [])
            if m.attention_layer_types is not None:  # DeepSeek-V4: its one key/value head stays whole, MoE layers too
                split = [("num_heads", m.num_heads), ("o_groups", m.o_groups)]
            for key, value in split:
                if value % tp:
                    raise ConfigError(f"model.{key} = {value} is not divisible by parallel.tp = {tp}"
                                      + (" (Mamba layers split their heads and groups over TP ranks)"
                                         if key.startswith("mamba") else ""))
            if getattr(m, "dsa_indexer_loss_coeff", 0) > 0:
                raise ConfigError(
                    f"model.dsa_indexer_loss_coeff = {m.dsa_indexer_loss_coeff} is not supported with parallel.tp = "
                    f"{tp} yet (its target sums the attention over every head, which TP splits); set it to 0")
            if m.vocab_size is not None and m.vocab_size % tp:
                raise ConfigError(
                    f"model.vocab_size = {m.vocab_size} is not divisible by parallel.tp = {tp} "
                    "(the embedding and output are split by vocabulary)"
                )
        n_stages = self.pp * self.pp_virtual_stages
        split = self.pp_layer_split
        if split is not None:
            if self.pp == 1:
                raise ConfigError("parallel.pp_layer_split is set but parallel.pp = 1")
            if len(split) != n_stages:
                raise ConfigError(
                    f"parallel.pp_layer_split has {len(split)} entries but there are pp*pp_virtual_stages = "
                    f"{n_stages} stages"
                )
            if sum(split) != m.num_layers:
                raise ConfigError(
                    f"parallel.pp_layer_split = {split} sums to {sum(split)}, not model.num_layers = {m.num_layers}"
                )
            for i, n in enumerate(split):
                if n < 0 or (n == 0 and 0 < i < n_stages - 1):
                    raise ConfigError(
                        f"parallel.pp_layer_split[{i}] = {n}: every middle stage needs >= 1 layer "
                        "(first/last may have 0: they hold the embedding/output)"
                    )
        if self.pp > 1 and self.pp_schedule in ("ZBVZeroBubble", "DualPipeV"):
            # the last stage's replica of the embedding table (see megapipe.parallel.pp) would sit beside the table
            what = ("model.tie_embeddings = true" if m.tie_embeddings else
                    f"model.mtp_num_layers = {m.mtp_depth}" if m.mtp_depth else None)
            if what:
                raise ConfigError(
                    f"{what} is not supported with parallel.pp_schedule = {self.pp_schedule!r} "
                    "(its first and last stages share a rank); use '1F1B' or 'Interleaved1F1B'"
                )
        if split is None and self.pp > 1 and m.num_layers < n_stages:
            raise ConfigError(
                f"model.num_layers = {m.num_layers} is smaller than pp*pp_virtual_stages = {n_stages} stages"
            )

    def _validate_hash_layers(self, m, seq: Optional[int]) -> None:
        """DeepSeek-V4's hash-routed MoE layers route by the token ids, which only the first pipeline stage gets."""
        if self.pp == 1 or not m.moe_hash_layers:
            return
        from megapipe.models.transformer import layer_flops_per_token
        from megapipe.parallel.pp import layer_split

        costs = layer_flops_per_token(m, seq or m.max_position_embeddings)
        first = layer_split(m.num_layers, self.pp * self.pp_virtual_stages, self.pp_layer_split, costs)[0]
        last = m.moe_layers[m.moe_hash_layers - 1]
        if last >= first:
            raise ConfigError(
                f"model.moe_hash_layers = {m.moe_hash_layers}: the hash-routed layers (up to layer {last}) must all "
                f"sit on the first pipeline stage, which holds {first} layer(s) (they route by the token ids, which "
                "later stages do not receive); set parallel.pp_layer_split"
            )

    def _validate_seq(self, seq: int) -> None:
        if self.cp > 1 and seq % (2 * self.cp):
            raise ConfigError(
                f"data.seq_length = {seq} is not divisible by 2*parallel.cp = {2 * self.cp} "
                "(load-balanced context parallelism cuts the sequence into 2*cp chunks)"
            )
        if self.tp > 1 and self.sequence_parallel and (seq // self.cp) % self.tp:
            raise ConfigError(
                f"data.seq_length / parallel.cp = {seq // self.cp} is not divisible by parallel.tp = {self.tp} "
                "(sequence parallelism splits the sequence over TP ranks); set parallel.sequence_parallel=false"
            )

    def _validate_train(self, t) -> None:
        dp = self.dp_size
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ConfigError(
                f"train.global_batch_size = {t.global_batch_size} is not divisible by train.micro_batch_size * "
                f"data-parallel size = {t.micro_batch_size}*{dp} = {t.micro_batch_size * dp}"
            )
        if self.pp > 1:
            local = t.global_batch_size // dp
            n = self.num_pp_microbatches(t)
            if local % n:
                raise ConfigError(
                    f"parallel.pp_microbatches = {n} does not divide the per-rank batch "
                    f"global_batch_size/dp = {local}"
                )
            stages = self.pp * self.pp_virtual_stages
            if self.pp_schedule in ("1F1B", "DualPipeV", "ZBVZeroBubble") and n < stages:
                raise ConfigError(
                    f"parallel.pp_schedule = {self.pp_schedule!r} needs at least {stages} micro-batches per step, "
                    f"got {n} (raise train.global_batch_size or parallel.pp_microbatches)"
                )
            if self.pp_schedule == "Interleaved1F1B":
                rounds = max(1, n // self.pp)
                if n % rounds:
                    raise ConfigError(
                        f"parallel.pp_schedule = 'Interleaved1F1B' needs the micro-batch count ({n}) to be a multiple "
                        f"of {rounds} (= micro-batches // pp)"
                    )
            if self.pp_schedule in ("ZBVZeroBubble", "DualPipeV") and (
                self.dp_mode == "fsdp" and (self.dp_shard * self.cp > 1 or self.dp_replicate > 1)
            ):
                raise ConfigError(
                    f"parallel.pp_schedule = {self.pp_schedule!r} with FSDP (dp_shard*cp*dp_replicate = "
                    f"{self.dp_shard * self.cp * self.dp_replicate}) loses the last stage's norm/output gradients in "
                    "torch 2.13: use 'Interleaved1F1B' or '1F1B' with data parallelism"
                )
            if t.compile and self.pp_schedule in ("ZBVZeroBubble", "DualPipeV"):
                raise ConfigError(
                    f"train.compile = true is not supported with parallel.pp_schedule = {self.pp_schedule!r} "
                    "(torch splits its backward into input/weight parts, which compile does not support)"
                )

    # ------------------------------------------------------------------------------------------- sizes

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def trivial(self) -> bool:
        return self.world_size == 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 shards over dp_shard x cp (CP ranks hold the same weights)."""
        return self.dp_mode == "fsdp" and self.dp_shard * self.cp > 1

    @property
    def loss_parallel(self) -> bool:
        return self.tp > 1

    def num_microbatches(self, train_cfg) -> int:
        """Gradient-accumulation micro-batches per step on one data-parallel rank."""
        return train_cfg.global_batch_size // (train_cfg.micro_batch_size * self.dp_size)

    def num_pp_microbatches(self, train_cfg) -> int:
        return self.pp_microbatches or self.num_microbatches(train_cfg)

    def describe(self) -> str:
        """Layout string like 'dp_shard2,tp2' (the form tools/loss_compare.py takes); 'single' for one process."""
        names = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        parts = [f"{n}{getattr(self, n)}" for n in names if getattr(self, n) > 1]
        return ",".join(parts) or "single"

    # ------------------------------------------------------------------------------------------- mesh

    def build_mesh(self, device_type: str = "cpu"):
        """The world DeviceMesh (all five dims, size-1 ones included, plus the flattened views); None for 1 process."""
        if self.trivial:
            return None
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        ep = self.ep > 1
        dims = EP_MESH_DIMS if ep else MESH_DIMS
        sizes = {**{n: getattr(self, n) for n in MESH_DIMS}, "edp": self.dp_shard // self.ep, "ep": self.ep}
        # one mesh per layout and process group: every mesh built holds process groups (and gloo's threads) for the
        # process's life, so a process that builds the same layout again (tests, a relaunched stage) reuses it
        key = (device_type, dims, tuple(sizes[n] for n in dims))
        world = dist.distributed_c10d._get_default_group()
        cached = _MESHES.get(key)
        if cached is not None and cached[0] is world:
            self.world_mesh, self.meshes = cached[1], dict(cached[2])
            return self.world_mesh
        mesh = init_device_mesh(device_type, tuple(sizes[n] for n in dims), mesh_dim_names=dims)
        meshes = {n: mesh[n] for n in dims}
        shard = ("edp", "ep") if ep else ("dp_shard",)
        # DeviceMesh has no public flatten/unflatten in torch 2.13 (torchtitan uses the same private methods); this
        # is the one place that calls them
        if ep:
            meshes["dp_shard"] = mesh[shard]._flatten("dp_shard")
            meshes["edp_cp"] = mesh["edp", "cp"]._flatten("edp_cp")
            meshes["ehsdp"] = mesh["dp_replicate", "edp", "cp"]._flatten("edp_dp_cp")._unflatten(
                0, (self.dp_replicate, sizes["edp"] * self.cp), ("dp_replicate", "edp_cp"))
        shard_cp = ("edp", "cp", "ep") if ep else ("dp_shard", "cp")
        meshes["dp"] = mesh[("dp_replicate", *shard)]._flatten("dp")
        meshes["dp_shard_cp"] = mesh[shard_cp]._flatten("dp_shard_cp")
        meshes["dp_cp"] = mesh[("dp_replicate", *shard_cp)]._flatten("dp_cp")
        # HSDP's 2-D mesh: replicate over dp_replicate, shard over dp_shard x cp
        meshes["hsdp"] = meshes["dp_cp"]._unflatten(
            0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp")
        )
        self.world_mesh, self.meshes = mesh, meshes
        _MESHES[key] = (world, mesh, dict(meshes))
        return mesh

    def mesh(self, name: str):
        """A 1-D mesh by name (pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp; with ep > 1 also ep, edp,
        edp_cp) or the 2-D 'hsdp' (and 'ehsdp': dp_replicate x edp_cp, the experts' HSDP mesh)."""
        return None if self.world_mesh is None else self.meshes[name]

    def group(self, name: str):
        return self.mesh(name).get_group()

    def local_rank(self, name: str) -> int:
        return 0 if self.world_mesh is None else self.meshes[name].get_local_rank()

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank reads (for the data loader: dp_rank, dp_size)."""
        return self.local_rank("dp")


def parse_layout(text: str) -> dict[str, int]:
    """'tp2,pp2' / 'dp_shard4' / 'dp2xcp2' -> {"tp": 2, "pp": 2, ...} ('dp' means dp_shard; 'single' is all 1)."""
    import re

    out: dict[str, int] = {}
    if text.strip() in ("", "single", "1"):
        return out
    for part in re.split(r",|x(?=d|cp|tp|pp|ep)", text.strip()):
        m = re.fullmatch(r"(dp_replicate|dp_shard|dp|cp|tp|pp|ddp|ep)(\d+)", part.strip())
        if not m:
            raise ConfigError(
                f"layout part {part!r} in {text!r} is not NAMEsize with NAME one of dp_replicate, dp_shard, dp, ddp, "
                "cp, tp, pp, ep (e.g. 'tp2,pp2')"
            )
        name = {"dp": "dp_shard"}.get(m.group(1), m.group(1))
        out[name] = int(m.group(2))
    return out


def layout_world_size(layout: dict[str, int]) -> int:
    """Processes a parsed layout needs (ep borrows from dp_shard: without dp_shard it is dp_shard's size)."""
    n = 1
    for k, v in layout.items():
        if k != "ep":
            n *= v
    if "ep" in layout and "dp_shard" not in layout:
        n *= layout["ep"]
    return n


def apply_layout(pcfg, layout: dict[str, int], schedule: str | None = None):
    """Set a parsed layout on a ParallelConfig (dims not named are 1; 'ddp' means dp_mode ddp); returns it."""
    pcfg.tp = pcfg.pp = pcfg.cp = pcfg.dp_replicate = pcfg.dp_shard = pcfg.ep = 1
    if "ep" in layout and "dp_shard" not in layout:
        pcfg.dp_shard = layout["ep"]  # 'ep2' alone: two FSDP ranks holding half of the experts each
    for k, v in layout.items():
        if k == "ddp":
            pcfg.dp_mode, pcfg.dp_replicate = "ddp", v
        else:
            setattr(pcfg, k, v)
    if schedule is not None:
        pcfg.pp_schedule = schedule
        pcfg.pp_virtual_stages = SCHEDULE_STAGES_PER_RANK[schedule] or 2
    return pcfg
