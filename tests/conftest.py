import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/fpref.py and helpers


@pytest.fixture
def memroot():
    """A unique memory:// root per test (fsspec's memory filesystem is process-global)."""
    import uuid

    import fsspec

    root = f"memory://certckpt-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    path = root[len("memory://") :]
    if fs.exists(path):
        fs.rm(path, recursive=True)
