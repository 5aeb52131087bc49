"""CPU threading for the predictor's torch work on a small shared machine.

With two cores and other processes running, OpenMP's default of spinning idle threads while they wait for
work costs more than it saves: one SmolLM2 decode step at batch 32 took 3.7-5.4 s with two spinning threads
against 0.2-0.7 s with ``OMP_WAIT_POLICY=PASSIVE``, under a load average of 6 on this 2-core machine. The
policy is read when torch's OpenMP runtime loads, so ``share_cpu`` must run before ``import torch``.
"""

from __future__ import annotations

import os
import sys


def share_cpu() -> bool:
    """Ask OpenMP to sleep, not spin, when idle (unless the user chose a policy); False if torch is already
    imported, in which case it is too late to take effect."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return "torch" not in sys.modules
