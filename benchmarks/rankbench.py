"""What the multi-rank benchmarks share: the machine's state around a run, and rank 0's progress.

``bench_detect.py``, ``bench_fsdp_detect.py`` and ``bench_false_triggers.py`` each run their ranks
once through ``certckpt.detect.launch.run_ranks``; the figures mean something only next to how busy
the machine was, so each report carries the load before and after and the CPU other processes used
meanwhile (``Machine``), and a long run shows rank 0's progress lines on stderr (``progress_tail``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import threading
from collections.abc import Iterator
from typing import Any

from bench_format import cpu_busy_seconds, loadavg, others_busy_cores, own_cpu_seconds

__all__ = ["Machine", "progress_tail"]


class Machine:
    """The machine's state for a report: ``start()`` before the ranks run, ``end()`` after.

    ``start`` warns on stderr when other processes already keep more than a quarter of a core busy
    (sampled for 0.1 s in tiny mode, 1 s otherwise) and returns the report's common config entries.
    """

    def __init__(self, *, tiny: bool) -> None:
        self.tiny = tiny
        self._busy0: float | None = None
        self._own0 = 0.0

    def start(self) -> dict[str, Any]:
        import torch

        busy = others_busy_cores(0.1 if self.tiny else 1.0)
        if busy is not None and busy > 0.25:
            print(f"warning: other processes keep {busy:.2f} cores busy; figures will be noisy", file=sys.stderr)
        self._busy0, self._own0 = cpu_busy_seconds(), own_cpu_seconds()
        return {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "loadavg_start": loadavg(),
            "others_busy_cores_before": busy,
        }

    def end(self) -> dict[str, Any]:
        """The config entries known once the run is over: the load then, and the CPU seconds other
        processes used during the run (where the system's counters can be read)."""
        out: dict[str, Any] = {"loadavg_end": loadavg()}
        busy1 = cpu_busy_seconds()
        if self._busy0 is not None and busy1 is not None:
            out["others_cpu_s_during_run"] = max(0.0, (busy1 - self._busy0) - (own_cpu_seconds() - self._own0))
        return out


@contextlib.contextmanager
def progress_tail(directory: str, banner: str) -> Iterator[str]:
    """Print ``banner``, then yield the path of a progress file in ``directory`` for rank 0 to append
    to; each line it writes is echoed on stderr (``  rank 0 ...``) until the block ends."""
    from certckpt.detect.launch import follow

    path = os.path.join(directory, "progress.log")
    open(path, "w").close()
    stop = threading.Event()
    tail = threading.Thread(
        target=follow,
        args=(path, stop, lambda ln: print(f"  rank 0 {ln}", file=sys.stderr, flush=True)),
        daemon=True,
    )
    tail.start()
    print(banner, file=sys.stderr)
    try:
        yield path
    finally:
        stop.set()
        tail.join()
