import pytest

from megapipe.config import Config, from_dict, load_config, to_dict
from megapipe.errors import ConfigError


def test_defaults_and_dotted_overrides():
    cfg = load_config(None, ["train.lr=3e-4", "model.preset=tiny", "data.data_path=[0.7, A, 0.3, B]"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.model.hidden_size == 256 and cfg.model.num_kv_heads == 4
    assert cfg.data.data_path == ["0.7", "A", "0.3", "B"]


def test_preset_fields_can_be_overridden():
    cfg = load_config(None, {"model.preset": "llama3-8b", "model.num_layers": 2})
    assert cfg.model.num_layers == 2 and cfg.model.hidden_size == 4096
    assert cfg.model.rope_scaling["factor"] == 8.0


def test_yaml_with_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  preset: tiny\ntrain:\n  lr: 1.0e-3\n  precision: bf16\n")
    cfg = load_config(p, ["train.precision=fp16"])
    assert cfg.train.lr == pytest.approx(1e-3) and cfg.train.precision == "fp16"


def test_round_trip_through_dict():
    cfg = load_config(None, ["model.preset=gpt2-124m", "parallel.tp=2"])
    again = from_dict(Config, to_dict(cfg))
    assert again == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1", "unknown key 'train.lrr' (allowed: "),
        ("train.precision=fp8", "train.precision = 'fp8' is not valid: expected one of 'fp32', 'bf16', 'fp16'"),
        ("train.micro_batch_size=3", "train.global_batch_size = 8 is not divisible by train.micro_batch_size = 3"),
        ("model.preset=nope", "model.preset = 'nope' is not a known model preset (allowed: tiny,"),
        ("model.num_layers=two", "model.num_layers = 'two' is not valid: expected int"),
        ("train.compile=3", "train.compile = 3 is not valid: expected bool"),
        ("model.num_layers=0", "model.num_layers = 0 must be > 0"),
        ("trainlr", "override 'trainlr' must look like section.key=value"),
        ("train.min_lr=1", "train.min_lr = 1.0 is larger than train.lr"),
        ("train.lr=-1", "train.lr = -1.0 must be >= 0"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_yaml_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  preset: tiny\ntrain:\n  lr: 3e-4\n  precison: bf16\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:5: unknown key 'train\.precison'"):
        load_config(p)
    p.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
