"""certckpt_cli: the command's exit codes, messages and commands."""
