"""Run a module as ``python -m`` does, in a process whose wall clock is shifted.

``python -m support.shifted_clock SECONDS MODULE ARGS...``: ``time.time`` and ``time.time_ns``
read SECONDS later than this machine's clock (a machine whose clock runs ahead, or behind with a
negative shift); everything else in the process is untouched. What the process asks a server
(S3's ``Date``, an object's ``LastModified``) still comes from the server's clock.
"""

from __future__ import annotations

import runpy
import sys
import time


def main() -> None:
    shift, module, *args = sys.argv[1:]
    seconds = float(shift)
    real, real_ns = time.time, time.time_ns
    time.time = lambda: real() + seconds  # type: ignore[assignment]
    time.time_ns = lambda: real_ns() + int(seconds * 1e9)  # type: ignore[assignment]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
