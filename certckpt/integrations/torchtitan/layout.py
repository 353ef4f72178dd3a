"""TorchTitan's checkpoint folder: its ``step-N`` directories, which are certified, which are plain.

TorchTitan names a checkpoint ``<folder>/step-<N>`` and takes it as valid when ``.metadata`` exists
in it. That file is DCP's ``Metadata`` pickled: certckpt never opens it. A certified directory has
``manifest.safetensors`` instead (``certckpt.dcp``); a directory with ``.metadata`` and no manifest
was written by plain TorchTitan and is refused with the way to bring it in (``IMPORT_HINT``).
After a resume certckpt trains on a new branch (``main-r1``...), whose directories are
``step-<N>-<branch>`` so that they never collide with what the abandoned branch left.
"""

from __future__ import annotations

import os
import re

from certckpt.errors import CheckpointNotFoundError, NotACheckpointError
from certckpt.format.sharded.layout import MANIFEST_NAME, exists, join, list_directory

__all__ = ["IMPORT_HINT", "is_plain_dcp", "refuse_plain", "step_directories", "step_directory_name"]

# TorchTitan's own pattern (``CheckpointManager._find_load_step``), anchored: ``step-12`` and
# certckpt's ``step-12-main-r1``; the branch part is what ``certckpt.trust.resume.next_branch`` makes.
_STEP_DIR = re.compile(r"^step-([0-9]+)(?:-([A-Za-z0-9_.-]+))?$")

IMPORT_HINT = (
    "to bring it in, load it once where you trust its pickle (TorchTitan's own CheckpointManager, then save with"
    " CertifiedCheckpointManager) or convert it (`python -m torch.distributed.checkpoint.format_utils dcp_to_torch"
    " DIR state.pt`, then `certckpt certify state.pt state.safetensors`)"
)


def step_directory_name(step: int, branch: str) -> str:
    """``step-N`` on ``main`` (TorchTitan's own name), ``step-N-<branch>`` on a resumed branch."""
    return f"step-{step}" if branch == "main" else f"step-{step}-{branch}"


def step_directories(folder: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``step-N[-branch]`` directory in ``folder``, by step then name."""
    try:
        names = list_directory(folder).dirs
    except CheckpointNotFoundError:  # no folder yet: a first run
        return []
    found = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m:
            found.append((int(m.group(1)), name))
    return [(step, join(folder, name)) for step, name in sorted(found)]


def is_plain_dcp(path: str) -> bool:
    """A directory plain DCP committed (its pickled ``.metadata``) that certckpt did not write."""
    return exists(join(path, ".metadata")) and not exists(join(path, MANIFEST_NAME))


def refuse_plain(path: str) -> None:
    """Raise, in one line, when ``path`` is a plain TorchTitan (DCP) checkpoint; never opens it.

    Raises:
        NotACheckpointError: ``path`` holds ``.metadata`` and no certified manifest.
    """
    if is_plain_dcp(path):
        raise NotACheckpointError(
            f"{os.fspath(path)}: a checkpoint written by plain TorchTitan (DCP's .metadata is a pickle, and"
            f" certckpt never unpickles); {IMPORT_HINT}"
        )
