"""The file: safetensors header and certckpt record, object <-> tensors, fingerprints and digests,
writing, reading, verifying, and the storage seam (local paths and fsspec URLs).

The lowest layer: it imports only ``certckpt.errors``. Modules that need torch import it themselves;
``header``, ``record``, ``verify`` and ``storage`` never do, so the CLI's verify path stays fast.
"""
