"""certckpt's version: one place, read by the package, the writer's inventory and the build."""

__version__ = "0.1.0"
