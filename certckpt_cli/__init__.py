"""The certckpt command-line front end (installed as the ``certckpt_cli`` package)."""
