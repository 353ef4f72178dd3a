"""The file: safetensors header and certckpt record, object <-> tensors, fingerprints and digests,
writing, reading and verifying, through ``certckpt.storage`` (local paths and fsspec URLs).

It imports only ``certckpt.storage`` and ``certckpt.errors``. Modules that need torch import it
themselves; ``header``, ``record`` and ``verify`` never do, so the CLI's verify path stays fast.
"""
