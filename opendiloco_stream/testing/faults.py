"""Fault injection for tests and benchmarks: a slower inner step, a state donor that dies mid-stream.

Off unless asked for, and not part of the configuration: a test or benchmark sets the environment
variable ``ODS_TEST_FAULTS`` for a peer process it starts (``step_delay_s=0.25``; several as
``a=1,b=2``), or calls :func:`inject` inside a process it drives. Each hook below is one check of
a module-level value where the fault happens; with nothing injected it does nothing.

- ``step_delay_s``: every inner step also sleeps this long, counted as compute (a slower peer).
- ``start_delay_s``: a ``peer`` sleeps this long once its model is built, before it says it is
  ready and joins (a peer that comes later, without its start-up's own time varying with load).
- ``die_after_tensors``: a donor serving its state exits (``os._exit``, no cleanup) when it is
  about to send tensor number N (a donor dying mid-download, at a known point).
"""

from __future__ import annotations

import os
import time
from typing import Optional

ENV = "ODS_TEST_FAULTS"
_KINDS = {"step_delay_s": float, "start_delay_s": float, "die_after_tensors": int}


def _from_env() -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        name, _, value = item.partition("=")
        if name not in _KINDS:
            raise ValueError(f"{ENV}: unknown fault {name!r}; known: {', '.join(_KINDS)}")
        out[name] = _KINDS[name](value)
    return out


_injected = _from_env()


def inject(**faults: float) -> None:
    """Turn faults on in this process (``inject(die_after_tensors=3)``); None turns one off."""
    for name, value in faults.items():
        if name not in _KINDS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(_KINDS)}")
        if value is None:
            _injected.pop(name, None)
        else:
            _injected[name] = _KINDS[name](value)


def env(**faults: float) -> dict[str, str]:
    """The environment entry that turns ``faults`` on in a process about to be started."""
    return {ENV: ",".join(f"{k}={v}" for k, v in faults.items())}


def slow_step() -> None:
    """Inside an inner step: sleep ``step_delay_s`` if injected."""
    delay = _injected.get("step_delay_s", 0.0)
    if delay > 0:
        time.sleep(delay)


def delay_start() -> None:
    """Once the model is built, before the join: sleep ``start_delay_s`` if injected."""
    delay = _injected.get("start_delay_s", 0.0)
    if delay > 0:
        time.sleep(delay)


def die_after_tensors() -> Optional[int]:
    """The tensor index at which a serving donor exits, if injected."""
    value = _injected.get("die_after_tensors")
    return None if value is None else int(value)
