import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapipe.errors import ConfigError
from megapipe.inference import host_memory
from megapipe.inference.engine import SamplingParams

SMAPS = """\
55d0a0000000-55d0a0600000 rw-p 00000000 00:00 0                          [heap]
Size:               6144 kB
Rss:                6144 kB
7f0000000000-7f0000800000 rw-p 00000000 00:00 0
Size:               8192 kB
Rss:                  12 kB
7f1000000000-7f1000400000 r--p 00000000 fd:01 1234                       /usr/lib/libfoo.so
Size:               4096 kB
Rss:                4096 kB
7f2000000000-7f2000400000 rw-s 00000000 00:05 77                         /dev/shm/x
Size:               4096 kB
Rss:                4096 kB
7f3000000000-7f3000a00000 rw-p 00000000 00:00 0
Size:              10240 kB
Rss:               10240 kB
VmFlags: rd wr mr mw me ac sd
"""


def test_smaps_parser_keeps_private_writable_anonymous_mappings_only():
    found = list(host_memory._anonymous_mappings(SMAPS))
    assert found == [(0x55D0A0000000, 0x55D0A0600000, 6144 * 1024), (0x7F0000000000, 0x7F0000800000, 12 * 1024),
                     (0x7F3000000000, 0x7F3000A00000, 10240 * 1024)]


def _collapse_supported() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return host_memory.thp_mode() in ("madvise", "always") and (major, minor) >= (6, 1)


def _huge_bytes_in(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings overlapping t's memory (madvise splits a mapping at huge-page bounds)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return sum(fields.get("AnonHugePages", 0)
               for lo, hi, _, _, fields in host_memory.mappings(Path("/proc/self/smaps").read_text())
               if lo < end and start < hi)


COLLAPSE = """
import sys
import torch
from megapipe.inference import host_memory
from tests.inference.test_host_memory import _huge_bytes_in, _collapse_failures
t = torch.ones(48 << 20, dtype=torch.uint8)  # resident: every page written
before, failed = _huge_bytes_in(t), _collapse_failures()
assert host_memory.collapse_resident_memory() >= 32 << 20
after = _huge_bytes_in(t)
if after < before + (32 << 20) and _collapse_failures() > failed:
    sys.exit(3)  # the kernel found no free 2 MiB pages for some ranges (fragmented memory): nothing to judge
assert after >= before + (32 << 20), (before, after)
assert float(t.float().mean()) == 1.0  # the contents survive
"""


def _collapse_failures() -> int:
    """The kernel's count of huge pages a collapse could not allocate (khugepaged's and MADV_COLLAPSE's)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, value = line.split()
        if name == "thp_collapse_alloc_failed":
            return int(value)
    return 0


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux >= 6.1 with transparent huge pages on")
def test_resident_memory_is_collapsed_into_huge_pages():
    """In a fresh process: in a long-lived one (a pytest worker after other tests) the tensor can land in a mapping
    that earlier allocations already made huge, leaving nothing to collapse."""
    root = Path(__file__).parents[2]
    out = subprocess.run([sys.executable, "-c", COLLAPSE], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=300)
    if out.returncode == 3:
        pytest.skip("the kernel had no free huge pages for the collapse (memory fragmented by the rest of the run)")
    assert out.returncode == 0, out.stderr[-3000:]


def test_small_models_skip_huge_pages_unless_asked(tiny_engine_factory):
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    auto = tiny_engine_factory(num_blocks=32)
    assert auto.runner.huge_page_bytes == 0  # a tiny model's weights live in the caches anyway
    forced = tiny_engine_factory(num_blocks=32, huge_pages=True)
    if host_memory.thp_mode() in ("madvise", "always"):
        assert forced.runner.huge_page_bytes > 0
    with pytest.raises(ConfigError, match=r"EngineConfig.huge_pages = 'yes' must be True, False or None"):
        tiny_engine_factory(num_blocks=32, huge_pages="yes")
    prompts = ["The capital of France is", "1 2 3"]
    assert ([o.outputs[0].token_ids for o in forced.generate(prompts, greedy)]
            == [o.outputs[0].token_ids for o in auto.generate(prompts, greedy)])
