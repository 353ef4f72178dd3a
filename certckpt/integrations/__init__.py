"""Adapters for the frameworks people already train with: ``lightning`` (a ``CheckpointIO`` plugin and an
audit callback), ``transformers`` (the Hugging Face ``Trainer``) and ``accelerate`` (Hugging Face
Accelerate's ``save_state``/``load_state`` and an audit for the user's own loop). Each module imports its
framework, installed with the matching extra (``pip install 'certckpt[lightning]'``); this package imports
nothing.
"""
