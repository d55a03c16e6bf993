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


@pytest.mark.parametrize("override, message", [
    ("train.lr=.nan", "train.lr (--lr) = nan must be a finite number"),
    ("train.lr=.inf", "train.lr (--lr) = inf must be a finite number"),
    ("train.lr=nan", "train.lr (--lr) = nan must be a finite number"),  # a string YAML reads as text, as --lr passes it
    ("train.min_lr=-.inf", "train.min_lr (--min-lr) = -inf must be a finite number"),
    ("optim.clip_grad=.inf", "optim.clip_grad (--clip-grad) = inf must be a finite number; use 0 for no clipping"),
    ("optim.weight_decay=.nan", "optim.weight_decay (--weight-decay) = nan must be a finite number"),
    ("optim.adam_eps=.nan", "optim.adam_eps = nan must be a finite number"),
    ("train.initial_loss_scale=.inf", "train.initial_loss_scale = inf must be a finite number"),
    ("model.rope_theta=.nan", "model.rope_theta = nan must be a finite number"),
    ("model.rope_scaling={factor: .inf}", "model.rope_scaling.factor = inf must be a finite number"),
    ("parallel.timeout_s=.inf", "parallel.timeout_s = inf must be a finite number"),
    ("data.data_path=[-0.5, A, 1, B]", "data.data_path (--data-path) weight -0.5 for prefix A must be a positive"),
    ("data.data_path=[.nan, A, 1, B]", "data.data_path (--data-path) weight nan for prefix A must be a positive"),
    ("data.data_path=[0, A, 1, B]", "data.data_path (--data-path) weight 0.0 for prefix A must be a positive"),
    ("data.data_path=[0.5, A, B]", "data.data_path (--data-path) ['0.5', 'A', 'B'] is malformed"),
    ("optim.adam_beta1=1.5", "optim.adam_beta1 (--adam-beta1) = 1.5 must be within [0, 1)"),
    ("optim.adam_beta2=-0.1", "optim.adam_beta2 (--adam-beta2) = -0.1 must be within [0, 1)"),
    ("optim.adam_eps=0", "optim.adam_eps = 0.0 must be > 0"),
    ("optim.clip_grad=-1", "optim.clip_grad (--clip-grad) = -1.0 must be >= 0"),
    ("optim.weight_decay=-1", "optim.weight_decay (--weight-decay) = -1.0 must be >= 0"),
])
def test_non_finite_and_out_of_range_values_are_refused_where_they_enter(override, message):
    import json

    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)
    json.dumps(load_config(None, []).__dict__, default=lambda o: o.__dict__, allow_nan=False)  # a valid one dumps


@pytest.mark.parametrize("preset, seq, ok", [("tiny", 2048, True), ("tiny", 2049, False), ("gpt2-124m", 1025, False),
                                             (None, 4096, None)])
def test_seq_length_beyond_the_position_limit_is_refused(preset, seq, ok):
    from megapipe.config import ModelConfig, check_seq_length

    overrides = {"data.seq_length": seq, **({"model.preset": preset} if preset else {})}
    if ok is False:
        with pytest.raises(ConfigError, match=rf"data\.seq_length \(--seq-length\) = {seq} is beyond the position "
                                              rf"limit of model '{preset}': model\.max_position_embeddings = {seq - 1}"):
            load_config(None, overrides)
        return
    cfg = load_config(None, overrides)  # no model given: it may come from a checkpoint, checked there
    if ok is None:
        with pytest.raises(ConfigError, match=r"beyond the position limit of the model: .* = 2048"):
            check_seq_length(ModelConfig(), seq)
    else:
        check_seq_length(cfg.model, seq)


def test_yaml_that_is_not_utf8_names_file_and_line(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("train:\n  lr: 1.0e-3\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml:3: not valid UTF-8 \(byte 0xe9 at byte offset 25"):
        load_config(p)
