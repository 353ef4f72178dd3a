"""certckpt.tools: the demo and the envelope harness."""
