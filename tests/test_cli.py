import os
import subprocess
import sys

from megapipe import __version__
from megapipe.cli import main


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"megapipe {__version__}"


def test_help_lists_stages():
    out = subprocess.run([sys.executable, "-m", "megapipe.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for stage in ("preprocess", "pretrain", "generate", "checkpoint"):
        assert stage in out.stdout


def test_unknown_command_fails():
    out = subprocess.run([sys.executable, "-m", "megapipe.cli", "no-such-stage"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "no-such-stage" in out.stderr


def test_export_group_is_shared():
    """Commands of one group share it, whichever adds to it first: `export trt` joins `export hf`."""
    import typer
    from typer.testing import CliRunner

    from megapipe import cli
    from stages import hf

    app = typer.Typer()
    cli.group(app, "export").command("trt")(lambda: None)
    cli.add_command(app, "import hf", hf.import_hf_command)
    cli.add_command(app, "export hf", hf.export_hf_command)
    result = CliRunner().invoke(app, ["export", "--help"])
    assert result.exit_code == 0 and " hf " in result.output and " trt " in result.output
    assert [g.name for g in app.registered_groups] == ["export", "import"]


def test_multi_value_options_stop_at_short_flags():
    from stages.common import spread_multi_values

    args = ["--input", "a", "b", "-q", "--data-path", "0.7", "A", "-0.5", "--json-keys=x", "y"]
    assert spread_multi_values(args, {"--input", "--data-path", "--json-keys"}) == [
        "--input", "a", "--input", "b", "-q", "--data-path", "0.7", "--data-path", "A", "--data-path", "-0.5",
        "--json-keys=x", "--json-keys", "y",
    ]


def test_interrupt_exits_130_with_a_message(capsys):
    from megapipe import cli

    @cli.app.command("interrupt-me", hidden=True)
    def _boom():
        raise KeyboardInterrupt

    try:
        assert cli.main(["interrupt-me"]) == 130
        assert "interrupted" in capsys.readouterr().err
    finally:
        cli.app.registered_commands.pop()


def test_arguments_that_are_not_utf8_are_one_sentence(tmp_path):
    """Real non-UTF-8 bytes on the command line (as a shell passes $'\\xff\\xfe'), never a traceback."""
    import os

    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    for argv, message in [
        ([b"generate", b"CKPT", b"--prompt", b"\xff\xfe"],
         "the argument after --prompt ('\\xff\\xfe') is not valid UTF-8: byte 0xff at offset 0"),
        ([b"generate", b"CKPT", b"--prompt=ab\xc3"], "the value of --prompt ('ab\\xc3') is not valid UTF-8: byte 0xc3 at offset 2"),
        ([b"checkpoint", b"inspect", b"run\xe9"], "argument 3 ('run\\xe9') is not valid UTF-8: byte 0xe9 at offset 3"),
    ]:
        out = subprocess.run([sys.executable.encode(), b"-m", b"megapipe.cli", *argv], capture_output=True, env=env,
                             cwd=tmp_path)
        err = out.stderr.decode()
        assert out.returncode == 2 and "Traceback" not in err, err
        assert message in err, err


def test_a_value_typer_cannot_convert_is_named():
    """typer says only what the value should be; every megapipe command also names the value given."""
    for argv, flag, value in ((["serve", "/nowhere", "--max-num-seqs", "abc"], "--max-num-seqs", "'abc'"),
                              (["generate", "/nowhere", "--temperature", "hot"], "--temperature", "'hot'"),
                              (["pretrain", "--train-iters", "1.5"], "--train-iters", "'1.5'")):
        out = subprocess.run([sys.executable, "-m", "megapipe.cli", *argv], capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "200"}, timeout=120)
        assert out.returncode == 2, argv
        assert f"Invalid value for '{flag}': {value}: input should be a valid" in out.stderr, out.stderr
