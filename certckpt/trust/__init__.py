"""Evidence and verdicts: ledger records, the pure certifier, incident rules (pure) and the run store
(the one place that reads and writes a run's ledger). Imports ``certckpt.format`` only; no torch.
"""
