"""Helpers shared by the stage commands."""

from __future__ import annotations

from typing import Optional

import typer

ORDER = 1000  # not a stage

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="YAML config file (same fields as the flags).")
SET_OPTION = typer.Option(None, "--set", help="Dotted config override, repeatable: --set train.lr=3e-4.")


def build_config(config: Optional[str], flags: dict, sets: Optional[list[str]]):
    """YAML file, then the flags the user gave (dotted key -> value, None = not given), then --set overrides."""
    from megapipe.config import load_config, parse_override

    overrides = {k: v for k, v in flags.items() if v is not None}
    for item in sets or []:
        k, v = parse_override(item)
        overrides[k] = v
    return load_config(config, overrides)
