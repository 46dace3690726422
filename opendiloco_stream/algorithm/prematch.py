"""Groups formed ahead of their rounds (``DiLoCoConfig.prematch_steps``, docs/architecture.md).

``K`` inner steps before a fragment's sync, the transport hears of the coming round
(``Transport.prematch``) with the weight the round will have if those steps bring as many tokens
as the last one, and the time until then (``K`` x a running mean of the time between steps), so
that it can form the round's group before the outer gradient exists.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.fragment_state import FragmentState
from opendiloco_stream.transport.base import OuterDigest, SwarmView


class Prematcher:
    """Tells ``transport`` of each round ``steps`` inner steps ahead (nothing if ``steps`` is 0);
    ``digest(fragment)``: the fingerprint of the latest theta_bar and the round it follows (``repair.py``)."""

    def __init__(self, transport: SwarmView, steps: int, weight: Callable[[int], float],
                 digest: Optional[Callable[[int], Optional[OuterDigest]]] = None):
        self.steps, self.weight, self.digest = steps, weight, digest
        self._prematch = transport.prematch if steps else None
        self.step_s: Optional[float] = None  # running mean of the time between steps
        self._last: Optional[float] = None

    def tick(self) -> None:
        """One inner step began (``StreamingDiLoCo.step``): update the step time."""
        now = time.monotonic()
        if self._last is not None:
            gap = now - self._last
            self.step_s = gap if self.step_s is None else 0.9 * self.step_s + 0.1 * gap
        self._last = now

    def after_step(self, t: int, frags: Sequence[FragmentState], inner_steps: int, tokens: int) -> None:
        """After inner step ``t`` (which brought ``tokens``): announce the rounds due at ``t + steps``."""
        if self._prematch is None:
            return
        for f in frags:
            s = fr.next_sync(t, f.offset, inner_steps)
            if s - t == self.steps:
                self._prematch((f.index, fr.round_index(s, f.offset, inner_steps)),
                               self.weight(f.tokens + self.steps * tokens), lead_s=self.steps * (self.step_s or 0.0),
                               digest=None if self.digest is None else self.digest(f.index))
