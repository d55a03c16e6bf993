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
