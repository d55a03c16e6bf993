"""Where the two files of a dataset ``PREFIX`` lie: ``PREFIX.bin`` (tokens) and ``PREFIX.idx`` (their index)."""

from __future__ import annotations

from pathlib import Path


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")
