"""The CLI's command functions, one module per stage (``COMMANDS`` in megapipe/cli.py lists them all). Thin: parse
options, build config, call the library; heavy imports stay inside the functions so ``megapipe --help`` is instant."""
