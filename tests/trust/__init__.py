"""certckpt.trust: ledgers, the certifier, incidents, the fleet registry, the trust kernel."""
