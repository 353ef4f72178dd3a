"""certckpt.storage: the Storage contract on each backend."""
