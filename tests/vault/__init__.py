"""certckpt.vault: promote, prune, restore and drill."""
