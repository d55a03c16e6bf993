"""Training metrics: throughput and MFU, and one logger writing a console line, ``metrics.jsonl`` and TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megapipe.errors import MegapipeError
from megapipe.fileio import write_text_atomic

# Dense bf16/fp16 tensor-core peak per device (FLOP/s), from the vendors' data sheets; fp32 runs use the same
# reference so MFU stays comparable across precisions (as Megatron and torchtitan report it).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
}


def device_peak_flops(device_type: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the override if given, else the table by CUDA device name, else None (CPU)."""
    if override:
        return float(override)
    if device_type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key]
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    return None if not peak else tokens_per_s_per_device * flops_per_token / peak


def _fmt(key: str, value) -> str:
    if value is None:
        return f"{key} n/a"
    if isinstance(value, float):
        if key in ("lr",):
            return f"{key} {value:.3e}"
        if key == "mfu":
            return f"{key} {100 * value:.1f}%"
        if key in ("tokens/s", "loss scale"):
            return f"{key} {value:,.0f}"
        if value and abs(value) < 1e-3:  # e.g. a log-prob mismatch of 2e-7 would print as 0.0000
            return f"{key} {value:.2e}"
        return f"{key} {value:.4f}"
    return f"{key} {value}"


class MetricsLogger:
    """Writes each record to ``run_dir/metrics.jsonl`` and TensorBoard, and prints a console line (unless quiet).

    Only rank 0 writes (``enabled``). ``resume_step``: records past it (written by a run that died after its last
    checkpoint) are dropped so the files describe one consistent run.
    """

    def __init__(self, run_dir: str | Path | None, enabled: bool = True, quiet: bool = False, resume_step: int = 0):
        self.enabled = enabled and run_dir is not None
        self.quiet = quiet or not enabled
        self.path = Path(run_dir) / "metrics.jsonl" if run_dir is not None else None
        self.resume_step = resume_step
        self._file = None
        self._tb = None
        self._console = None
        self._opened = False

    def _open(self) -> None:
        """Create the files at the first record, so that a run refused before its first step writes nothing."""
        self._opened = True
        if not self.enabled:
            return
        resume_step = self.resume_step
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MegapipeError(f"cannot create the run directory {self.path.parent}: {e.strerror}") from None
        _truncate_after(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=resume_step + 1)
        except ImportError:  # tensorboard is a dependency, but metrics must never stop a run
            self._tb = None

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(highlight=False, soft_wrap=True)
        return self._console

    def print(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text)

    def log(self, record: dict, kind: str = "train") -> None:
        """``record`` must hold ``step``; floats that are nan/inf are written as null in JSON."""
        step = record["step"]
        if not self._opened:
            self._open()
        if self._file is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self._file.write(json.dumps({"kind": kind, **clean}) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
        if not self.quiet:
            if kind == "train":
                keys = [("loss", "loss"), ("lr", "lr"), ("grad_norm", "grad_norm"), ("tokens_per_s", "tokens/s"),
                        ("mfu", "mfu"), ("loss_scale", "loss scale"), ("skipped", "skipped")]
                parts = [_fmt(label, record.get(k)) for k, label in keys if k in record and (k != "skipped" or record[k])]
                known = {k for k, _ in keys} | {"step", "tokens_seen"}
                # per-part details (e.g. moe/L3/aux_loss) go to the files only
                parts += [_fmt(k, v) for k, v in record.items() if k not in known and k.count("/") < 2]
                self.console.print(f"[bold]step {step}[/] | " + " | ".join(parts))
            else:
                parts = [_fmt(k, v) for k, v in record.items() if k != "step"]
                self.console.print(f"[bold cyan]{kind} @ step {step}[/] | " + " | ".join(parts))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _truncate_after(path: Path, step: int) -> None:
    """Drop records with step > ``step`` (atomically: temp file, then rename)."""
    if not path.exists():
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:  # a line cut by a kill -9
                continue
    write_text_atomic(path, "".join(keep))


class Window:
    """Sums since the last log line (loss and metrics over non-skipped steps), plus run totals for the summary."""

    def __init__(self):
        self.total_tokens, self.total_time, self.last_loss = 0, 0.0, None
        self._reset()

    def _reset(self):
        self.loss_sum, self.loss_n, self.tokens, self.time, self.skipped = 0.0, 0, 0, 0.0, 0
        self.metric_sums: dict[str, float] = {}

    def add(self, out: dict, tokens: int, seconds: float) -> None:
        if math.isfinite(out["loss"]):
            self.loss_sum += out["loss"]
            self.loss_n += 1
            self.last_loss = out["loss"]
            for k, v in out.items():
                if k not in _STEP_KEYS and isinstance(v, float):
                    self.metric_sums[k] = self.metric_sums.get(k, 0.0) + v
        self.skipped += out["skipped"]
        self.tokens += tokens
        self.time += seconds
        self.total_tokens += tokens
        self.total_time += seconds

    def flush(self) -> dict:
        n = self.loss_n
        w = {
            "loss": self.loss_sum / n if n else float("nan"),
            "tokens": self.tokens,
            "time": self.time,
            "skipped": self.skipped,
            "metrics": {k: v / n for k, v in self.metric_sums.items()},
        }
        self._reset()
        return w


_STEP_KEYS = ("loss", "skipped", "grad_norm", "lr")
