import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROBE = ("import os, sys; from megapipe.omp import prefer_passive_wait; {pre}set_ = prefer_passive_wait(); "
         "print(set_, os.environ.get('OMP_WAIT_POLICY'))")


def probe(pre: str = "", **env) -> str:
    import os

    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    out = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], env=environ, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_passive_wait_is_set_before_torch_loads_and_never_over_the_users_choice():
    assert probe() == "True PASSIVE"
    assert probe(OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE"
    assert probe(pre="import torch; ") == "False None"  # too late: the runtime has read its policy

