import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROBE = ("import os, sys; from megapipe.omp import prefer_bounded_spin; {pre}set_ = prefer_bounded_spin(); "
         "print(set_, os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")


def probe(pre: str = "", **env) -> str:
    import os

    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    out = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], env=environ, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_bounded_spin_is_set_before_torch_loads_and_never_over_the_users_choice():
    from megapipe.omp import SPIN_COUNT

    assert probe() == f"True {SPIN_COUNT} PASSIVE"
    assert probe(OMP_WAIT_POLICY="ACTIVE") == "False None ACTIVE"
    assert probe(GOMP_SPINCOUNT="100") == "False 100 None"
    assert probe(pre="import torch; ") == "False None None"  # too late: the runtime has read its policy


def test_serve_hands_vllm_its_own_openmp_defaults(tmp_path):
    """``serve --engine vllm`` starts vLLM's server without megapipe's bounded spin (it cost vLLM ~20% of its
    throughput), and with the user's own policy. The vLLM environment's interpreter is a stand-in here that answers
    the import probe and records the environment the server would have started with."""
    import os

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    record = tmp_path / "env.txt"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then printf stand-in; exit 0; fi\nenv > {record}\n')
    python.chmod(0o755)

    def served_env(**env) -> dict:
        environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
        subprocess.run([sys.executable, "-m", "megapipe.cli", "serve", str(model), "--engine", "vllm",
                        "--vllm-python", str(python), "--port", "0"], env=environ, capture_output=True, text=True,
                       check=True, timeout=50)
        return dict(line.split("=", 1) for line in record.read_text().splitlines() if "=" in line)

    seen = served_env()
    assert "GOMP_SPINCOUNT" not in seen and "OMP_WAIT_POLICY" not in seen
    assert served_env(OMP_WAIT_POLICY="ACTIVE")["OMP_WAIT_POLICY"] == "ACTIVE"
