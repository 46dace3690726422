"""Fault injection for tests and benchmarks: a slower inner step, a state donor that dies mid-stream.

Off unless asked for, and not part of the configuration: a test or benchmark sets the environment
variable ``ODS_TEST_FAULTS`` for a peer process it starts (``step_delay_s=0.25``; several as
``a=1,b=2``), or calls :func:`inject` inside a process it drives. Each hook below is one check of
a module-level value where the fault happens; with nothing injected it does nothing.

- ``step_delay_s``: every inner step also sleeps this long, counted as compute (a slower peer).
- ``start_delay_s``: a ``peer`` sleeps this long once its model is built, before it says it is
  ready and joins (a peer that comes later, without its start-up's own time varying with load).
- ``die_after_tensors``: a donor serving its state exits (``os._exit``, no cleanup) when it is
  about to send tensor number N (a donor dying mid-download, at a known point). Serving on several
  lanes, each lane stops at tensor N or later and the process exits ``DIE_GRACE_S`` after the
  first one got there (:func:`stop_lane`): the lanes behind send their parts of the tensors before
  N meanwhile, so the joiner holds tensors 0 to N-1 whole. Without the grace, a loaded machine's
  lanes behind had sent none of their parts when the first exited, and the joiner kept no whole
  tensor (a fresh-clone suite, test_hivemind_transport's resume test).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Optional

ENV = "ODS_TEST_FAULTS"
_KINDS = {"step_delay_s": float, "start_delay_s": float, "die_after_tensors": int}
DIE_GRACE_S = 2.0  # from the first lane stopped at tensor N to the exit
_exit_timer: Optional[threading.Timer] = None


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


async def stop_lane() -> None:
    """Inside a donor's lane that reached tensor ``die_after_tensors``: never returns; the first
    call schedules the process's exit (``os._exit(1)``) ``DIE_GRACE_S`` later."""
    global _exit_timer
    if _exit_timer is None:
        _exit_timer = threading.Timer(DIE_GRACE_S, os._exit, args=(1,))
        _exit_timer.daemon = True
        _exit_timer.start()
    await asyncio.Event().wait()
