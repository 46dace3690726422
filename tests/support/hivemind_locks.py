"""The test process's guard against hivemind locks left held by a process that was killed.

hivemind 1.1.12 guards its futures with ``multiprocessing`` locks created at import and shared by
every process forked afterwards (``MPFuture._update_lock``, ``_initialization_lock``,
``SharedBytes._lock``). A DHT process killed by a signal while it holds one leaves it held for
good, and every later DHT start in the process that forked it hangs (the new DHT cannot create or
deliver a future).

A peer, a bootstrap or ``monitor`` starts one DHT per process, and ``stop_dht`` warns when it had
to kill one ("restart the process"), so the package needs no guard. The test process is different:
it starts dozens of DHT nodes in-process and kills some of them on purpose, and without this guard
the DHT tests after such a kill hung (4 failed, 4 errors in test_net, in two suite runs). hivemind
offers no public probe of these locks, so this module reads its private class attributes: the one
place that does, and it is not in the package. ``tests/conftest.py`` calls it before every test
once hivemind is imported.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def unstick_hivemind_locks(timeout: float = 1.0) -> bool:
    """Reset hivemind's cross-process future locks if a dead process holds one; True if it did.
    A lock that stays held for ``timeout`` seconds is such a lock; hivemind's own
    ``MPFuture.reset_backend`` then replaces them (futures pending in this process are lost: they
    could not complete anyway)."""
    if "hivemind.utils.mpfuture" not in sys.modules:  # nothing forked with its locks yet
        return False
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    for lock in (MPFuture._initialization_lock, MPFuture._update_lock, SharedBytes._lock):
        if not lock.acquire(timeout=timeout):
            logger.warning("a hivemind cross-process lock is held by a process that died (killed by a signal?): "
                           "resetting hivemind's future backend")
            MPFuture.reset_backend()
            return True
        lock.release()
    return False
