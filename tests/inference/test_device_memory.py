"""--gpu-memory-utilization: the KV cache's default size on CUDA (megapipe/inference/device_memory.py) from the
GPU's figures; the engine on a real GPU is in tests/gpu/test_engine_cuda.py."""

from __future__ import annotations

import pytest

from megapipe.errors import ConfigError
from megapipe.inference.device_memory import CUDA_SLACK, kv_memory_of, step_reserve
from megapipe.inference.engine import EngineConfig

GiB = 1 << 30


def test_the_kv_cache_gets_the_share_less_what_is_used_and_a_step_up_to_what_the_batch_needs():
    # 80 GiB GPU at 0.9: 72 GiB allowed, 10 in use, 2 for a step: 60 GiB left
    assert kv_memory_of(80 * GiB, 10 * GiB, 0.9, 2 * GiB, wanted=100 * GiB, minimum=GiB) == 60 * GiB
    assert kv_memory_of(80 * GiB, 10 * GiB, 0.9, 2 * GiB, wanted=5 * GiB, minimum=GiB) == 5 * GiB
    assert kv_memory_of(80 * GiB, 10 * GiB, 0.5, 2 * GiB, wanted=100 * GiB, minimum=GiB) == 28 * GiB


def test_too_little_left_for_one_sequence_is_an_error_naming_the_flag_and_the_figures():
    with pytest.raises(ConfigError) as err:
        kv_memory_of(16 * GiB, 14 * GiB, 0.9, GiB, wanted=8 * GiB, minimum=GiB)
    message = str(err.value)
    assert message.startswith("--gpu-memory-utilization 0.9 allows 14.40 GiB of the GPU's 16.00 GiB, of which "
                              "14.00 GiB are in use")
    assert "leaving 0.00 GiB for the KV cache where one sequence of --max-model-len needs 1.000 GiB" in message
    kv_memory_of(16 * GiB, 12 * GiB, 0.9, GiB, wanted=8 * GiB, minimum=GiB)  # 1.4 GiB left: enough


def test_a_step_reserve_counts_the_token_budget_and_the_sampled_rows_logits():
    # SmolLM2-135M's shape in bf16, vLLM's 2048-token budget, 256 sampled rows
    per_token = (6 * 576 + 2 * 1536) * 2
    assert step_reserve(576, 1536, 49152, 2048, 256, 2) == 2 * 2048 * per_token + 4 * 256 * 49152 * 4 + CUDA_SLACK
    assert step_reserve(576, 1536, 49152, 4096, 256, 2) > step_reserve(576, 1536, 49152, 2048, 256, 2)


@pytest.mark.parametrize("value", [0, -0.1, 1.5, True, "0.9", None])
def test_engine_config_refuses_a_share_outside_0_to_1(value):
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization = .* must be a number in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value).check()


def test_vllm_gets_the_share_where_one_is_given(tmp_path):
    from megapipe.inference.vllm_engine import vllm_command

    common = dict(host="127.0.0.1", port=1, api_key=None, served_model_name="m", max_num_seqs=8, max_model_len=None,
                  dtype="auto")
    cmd = vllm_command(tmp_path / "python", tmp_path, gpu_memory_utilization=0.75, **common)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.75"
    assert "--gpu-memory-utilization" not in vllm_command(tmp_path / "python", tmp_path, **common)
    # serve --block-size goes to vLLM where given; without it vLLM keeps its own default (128 on a CPU, as ours)
    cmd = vllm_command(tmp_path / "python", tmp_path, block_size=64, **common)
    assert cmd[cmd.index("--block-size") + 1] == "64"
    assert "--block-size" not in vllm_command(tmp_path / "python", tmp_path, **common)
