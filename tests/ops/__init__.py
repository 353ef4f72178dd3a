"""certckpt.ops: the planner, the report and its drawings, releases."""
