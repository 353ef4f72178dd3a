"""Issue 45, item 4: ``Auditor.async_save`` is documented (docs/detection.md, "Saving without
stopping"): its signature, what it returns on rank 0 and on the other ranks, and an example that runs
on 3 gloo ranks, as the docs test runs it (the same block, alone here)."""

from __future__ import annotations

import inspect
import os

import pytest

from certckpt.detect import Auditor
from tests.support.docrunner import parse, run
from tests.support.helpers import ROOT

DETECTION = os.path.join(ROOT, "docs", "detection.md")


def _section() -> str:
    with open(DETECTION, encoding="utf-8") as f:
        text = f.read()
    start = text.index("### Saving without stopping: `Auditor.async_save`")
    return text[start : text.index("\n### ", start + 1)]


def test_auditor_async_save_documents_its_signature_and_returns():
    section = _section()
    params = list(inspect.signature(Auditor.async_save).parameters)
    assert params == ["self", "obj", "f", "kwargs"]  # what the doc shows: async_save(obj, f, **kwargs)
    assert "`auditor.async_save(obj, f, **kwargs) -> SaveFuture | None`" in section
    assert "**On rank 0** it returns a `SaveFuture`" in section
    assert "**On every other rank** it returns `None`" in section
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "`Auditor.async_save` inside a DDP loop, `docs/detection.md`" in f.read()


@pytest.mark.slow
def test_auditor_async_save_example_runs_on_3_ranks(tmp_path):
    doc = parse(DETECTION)
    doc.blocks = [b for b in doc.blocks if b.torchrun and b.torchrun[1] == "async_save.py"]
    assert len(doc.blocks) == 1 and "auditor.async_save(" in doc.blocks[0].code
    run(doc, str(tmp_path))
