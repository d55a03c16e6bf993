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
