"""keep_freed_memory: a large tensor freed and allocated again no longer faults its pages back in (after a few
rounds in which glibc's heap settles: memalign'ed blocks need some slack before a freed one fits again)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from megapipe.training.cpu_memory import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory() and keep_freed_memory()  # once per process; a second call is a no-op
    def faults_of_one_step():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(64 * 2**20 // 4)  # 64 MB, written, then freed
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print([faults_of_one_step() for _ in range(10)][-1])
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")
def test_a_freed_large_tensor_is_reused_without_page_faults():
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert faults("default") > 10_000  # 64 MB = 16k pages of 4 kB, returned to the kernel and faulted in again
    assert faults("keep") < 1_000
