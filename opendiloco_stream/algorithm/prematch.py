"""Groups formed ahead of their rounds (``DiLoCoConfig.prematch_steps``, docs/architecture.md).

``K`` inner steps before a fragment's sync, the transport hears of the coming round
(``Transport.prematch``) with the weight the round will have if those steps bring as many tokens
as the last one, and the time until then (``K`` x a running mean of the time between steps), so
that it can form the round's group before the outer gradient exists.

``prematch_steps = "auto"`` (the default) sizes ``K`` from the link: matchmaking costs about
``PREMATCH_AUTO_RTTS`` round trips, so a group formed that long ahead leaves the round with its
exchange only. ``K`` is 0 while the transport has measured no groupmate's round-trip time
(``SwarmView.groupmate_rtt_s``: over hivemind, DHT pings to the swarm's peers from its start until
its rounds measure groupmates; in-process transports never measure one) or while the worst is under
``PREMATCH_AUTO_MIN_RTT_MS``, else ``ceil(PREMATCH_AUTO_RTTS x RTT / step time)``, at least 1 and at
most H - 1 (a fragment's group forms after its previous round: ``DiLoCoConfig``'s check). The step
time there is the median of the recent gaps between steps: a blocking round's wait lengthens only
its own step, and the steps between an announcement and its round are usually compute alone.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.fragment_state import FragmentState
from opendiloco_stream.config import PREMATCH_AUTO_MIN_RTT_MS, PREMATCH_AUTO_RTTS
from opendiloco_stream.transport.base import OuterDigest, SwarmView

logger = logging.getLogger(__name__)

STEP_GAPS = 32  # gaps between steps "auto" takes the median of


@dataclass(frozen=True)
class PrematchChoice:
    """How many inner steps ahead groups form now, and why (what the start-up lines and the summary say)."""

    steps: int
    auto: bool
    rtt_s: Optional[float] = None  # the worst groupmate RTT it was sized from (auto)
    step_s: Optional[float] = None  # the step time it was sized from (auto)

    def describe(self) -> str:
        if not self.auto:
            return f"{self.steps} inner steps ahead (--prematch-steps {self.steps})" if self.steps else \
                "off (--prematch-steps 0: each group forms at its round)"
        if self.rtt_s is None:
            return "auto: 0 (no groupmate's round-trip time measured yet)"
        rtt_ms = self.rtt_s * 1e3
        if not self.steps:
            return f"auto: 0 (worst groupmate RTT {rtt_ms:.0f} ms < {PREMATCH_AUTO_MIN_RTT_MS:g} ms)"
        step = f"{self.step_s:.2f} s" if self.step_s else "not measured"
        return (f"auto: {self.steps} inner steps ahead (worst groupmate RTT {rtt_ms:.0f} ms: "
                f"{PREMATCH_AUTO_RTTS} round trips of matchmaking at steps of {step})")


def auto_steps(rtt_s: Optional[float], step_s: Optional[float], inner_steps: int) -> int:
    """``prematch_steps = "auto"``'s K for a worst groupmate RTT and a step time (module docstring)."""
    if rtt_s is None or rtt_s * 1e3 < PREMATCH_AUTO_MIN_RTT_MS or inner_steps < 2:
        return 0
    k = math.ceil(PREMATCH_AUTO_RTTS * rtt_s / step_s) if step_s else 1
    return max(1, min(k, inner_steps - 1))


class Prematcher:
    """Tells ``transport`` of each round ``steps`` inner steps ahead (nothing at 0; ``"auto"``: a
    number of steps sized from the measured link, see the module docstring). ``on_change`` hears a
    ``{"event": "prematch"}`` record when "auto" starts or stops forming groups ahead.
    ``digest(fragment)``: the fingerprint of the latest theta_bar and the round it follows (``repair.py``)."""

    def __init__(self, transport: SwarmView, steps: int | str, weight: Callable[[int], float],
                 digest: Optional[Callable[[int], Optional[OuterDigest]]] = None,
                 on_change: Optional[Callable[[dict[str, Any]], None]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.transport, self.weight, self.on_change, self.clock = transport, weight, on_change, clock
        self.digest = digest
        self.auto = steps == "auto"
        self.steps = 0 if self.auto else int(steps)
        self.choice = PrematchChoice(self.steps, self.auto)
        self.step_s: Optional[float] = None  # running mean of the time between steps
        self._gaps: deque[float] = deque(maxlen=STEP_GAPS)  # the recent gaps between steps ("auto")
        self._last: Optional[float] = None
        self._announced: dict[int, int] = {}  # fragment -> the last round announced ahead (auto)

    def tick(self) -> None:
        """One inner step began (``StreamingDiLoCo.step``): update the step time."""
        now = self.clock()
        if self._last is not None:
            gap = now - self._last
            self.step_s = gap if self.step_s is None else 0.9 * self.step_s + 0.1 * gap
            self._gaps.append(gap)
        self._last = now

    def _resize(self, inner_steps: int) -> int:
        """``"auto"``: K from the transport's latest measure (said when groups start or stop forming ahead)."""
        rtt = self.transport.groupmate_rtt_s()
        step_s = statistics.median(self._gaps) if self._gaps else None
        k = auto_steps(rtt, step_s, inner_steps)
        before, self.choice = self.choice, PrematchChoice(k, True, rtt, step_s)
        if (k > 0) != (before.steps > 0):
            logger.info("groups formed ahead: %s", self.choice.describe())
            if self.on_change is not None:
                self.on_change({"event": "prematch", "steps": k, "auto": True,
                                "rtt_ms": None if rtt is None else round(rtt * 1e3, 1),
                                "step_s": None if step_s is None else round(step_s, 4),
                                "why": self.choice.describe()})
        return k

    def after_step(self, t: int, frags: Sequence[FragmentState], inner_steps: int, tokens: int) -> None:
        """After inner step ``t`` (which brought ``tokens``): announce the rounds due within the lead.

        A set K announces each round exactly K steps before its sync. Under ``"auto"`` K follows
        the link and the step time, so each round is announced once, at the first step within K of
        its sync (fewer steps ahead where K grew past it)."""
        k = self._resize(inner_steps) if self.auto else self.steps
        if not k:
            return
        for f in frags:
            s = fr.next_sync(t, f.offset, inner_steps)
            ahead = s - t
            if self.auto:
                round_index = fr.round_index(s, f.offset, inner_steps)
                if not 1 <= ahead <= k or self._announced.get(f.index) == round_index:
                    continue
                self._announced[f.index] = round_index
            elif ahead != k:
                continue
            self.transport.prematch((f.index, fr.round_index(s, f.offset, inner_steps)),
                                    self.weight(f.tokens + ahead * tokens), lead_s=ahead * (self.step_s or 0.0),
                                    digest=None if self.digest is None else self.digest(f.index))
