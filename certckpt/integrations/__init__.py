"""Adapters for the frameworks people already train with: ``lightning`` (a ``CheckpointIO`` plugin and an
audit callback) and ``transformers`` (the Hugging Face ``Trainer``). Each module imports its framework,
installed with the matching extra (``pip install 'certckpt[lightning]'``); this package imports nothing.
"""
