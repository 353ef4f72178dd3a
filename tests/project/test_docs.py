"""The README and docs/*.md as a contract: every code block runs as shown, in a fresh directory, in the
order a reader meets it, and prints what it shows (``tests/support/docrunner.py`` says how blocks are marked).
Blocks that cannot run here are skipped with their reason, listed by ``test_every_skip_says_why``."""

from __future__ import annotations

import glob
import os

import pytest

from tests.support import helpers
from tests.support.docrunner import parse, run

ROOT = str(helpers.ROOT)
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _param(path: str):
    doc = parse(path)
    return pytest.param(doc, id=os.path.relpath(path, ROOT), marks=[pytest.mark.slow] if doc.slow else [])


@pytest.mark.parametrize("doc", [_param(p) for p in DOCS])
def test_every_code_block_runs_as_shown(doc, tmp_path):
    run(doc, str(tmp_path))


def test_every_skip_says_why():
    skipped = [f"{b.where}: {b.skip}" for p in DOCS for b in parse(p).blocks if b.skip is not None]
    assert all(line.split(": ", 1)[1].strip() for line in skipped), skipped
    print("\n".join(skipped))  # `pytest -s -k skip_says_why` lists the blocks that are not executed
