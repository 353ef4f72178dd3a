"""certckpt.detect: the audits on real gloo ranks, their pure parts, the launcher."""
