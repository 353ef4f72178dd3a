"""certckpt.dcp: certified sharded DCP checkpoints."""
