"""User-facing errors: one clear sentence naming the culprit, turned into a non-zero exit by the CLI."""

from __future__ import annotations


class MegapipeError(Exception):
    """A mistake the user can fix (bad input, bad config, bad checkpoint). Printed without a traceback."""

    exit_code = 2


class ConfigError(MegapipeError):
    """A config key or value is unknown or out of range."""


class DataError(MegapipeError):
    """Input data is missing, unreadable or malformed."""


class CheckpointError(MegapipeError):
    """A checkpoint is missing, incomplete, corrupted or does not match the model."""
