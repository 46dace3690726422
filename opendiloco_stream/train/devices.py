"""Where a peer trains (``train.device``) and where its outer state lives (``diloco.outer_device``).

``device = "auto"`` (the default) is the first CUDA device when torch sees one, else the CPU: a
peer on a GPU machine trains on the GPU with no flag. An explicit ``cpu`` on a machine whose GPU
torch sees gets a one-line notice (it is allowed: you may keep the GPU for something else).

Where the outer state goes (``outer_device = "auto"``: the GPU when it fits next to the model and
its AdamW state, else pinned host memory) is ``algorithm/staging.py``'s ``place_outer_state``.
"""

from __future__ import annotations

from typing import Optional

import torch


def cuda_visible() -> int:
    """How many CUDA devices torch can use here (0 without a driver, a CPU build, or none visible)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(setting: str, ranks: int = 1) -> str:
    """``train.device`` as the trainer uses it: ``auto`` becomes ``cuda:0`` (``cuda`` with several
    ranks: rank r takes ``cuda:r``) when torch sees a CUDA device, else ``cpu``; others stay."""
    if setting != "auto":
        return setting
    if cuda_visible() == 0:
        return "cpu"
    return "cuda" if ranks > 1 else "cuda:0"


def describe_device(setting: str, resolved: str) -> str:
    """The start-up / ``--dry-run`` / summary line: ``cuda:0 (NVIDIA H100 80GB HBM3; auto)``."""
    how = "auto" if setting == "auto" else "--device"
    if resolved.startswith("cuda"):
        index = torch.device(resolved).index or 0
        return f"{resolved} ({torch.cuda.get_device_name(index)}; {how})"
    if setting == "auto":
        return f"{resolved} (auto: torch {torch.__version__} sees no CUDA device)"
    return f"{resolved} ({how})"


def idle_gpu_notice(setting: str) -> Optional[str]:
    """One line when the CPU was asked for explicitly and torch sees a GPU here, else None."""
    count = cuda_visible() if setting == "cpu" else 0
    if count == 0:
        return None
    return (f"note: training on the CPU (--device cpu) while torch sees {count} CUDA device(s) here "
            f"({torch.cuda.get_device_name(0)}): drop --device cpu, or pass --device auto, to train on the GPU")
