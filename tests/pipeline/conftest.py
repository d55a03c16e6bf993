"""Fixtures of the pipeline tests: small pipeline files over the bundled excerpt, and a real Slurm cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.slurm_cluster import SlurmCluster

PIPELINES = Path(__file__).parent / "pipelines"


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A single-node Slurm cluster of this machine's CPUs for the session (skips, with the reason, where it cannot
    start); SLURM_CONF points at it while it runs."""
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    reason = cluster.start()
    if reason is not None:
        cluster.stop()
        pytest.skip(reason)
    old = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        cluster.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
