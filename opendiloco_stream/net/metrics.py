"""Per-peer training metrics on the DHT: signed, schema-checked, expiring records.

Each peer stores one record under ``run_key(run_id, "metrics")`` with its RSA public key as the
subkey. hivemind's ``RSASignatureValidator`` signs it, so only the owner of a subkey can write it,
and a ``SchemaValidator`` rejects anything that does not match :class:`PeerMetrics` exactly (no
type conversions, no extra fields). Every node that stores or reads these records must install the
same validators (:func:`install_validators`): a node without them would accept forged entries, and
readers reject a whole dictionary that contains one bad entry.

Records expire ``expiration`` seconds after they were stored; the publisher re-stores the last
record before that, so a live peer never disappears from ``monitor`` while a dead one does.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from typing import Any, Dict, Optional

import pydantic.v1 as pydantic  # hivemind's SchemaValidator is written against pydantic v1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic.v1 import StrictFloat, confloat, conint, constr

from opendiloco_stream.net.keys import run_key, run_prefix
from opendiloco_stream.stats import SyncStats

logger = logging.getLogger(__name__)


class PeerMetrics(pydantic.BaseModel):
    """One peer's latest numbers. Strict types: the schema validator forbids any conversion."""

    name: constr(strict=True, max_length=64)
    peer_id: constr(strict=True, max_length=128)
    step: conint(strict=True, ge=0)
    loss: Optional[StrictFloat]
    tokens_per_s: confloat(strict=True, ge=0.0)
    bytes_sent: conint(strict=True, ge=0)
    bytes_received: conint(strict=True, ge=0)
    compute_utilization: Optional[confloat(strict=True, ge=0.0, le=1.0)]
    rounds: conint(strict=True, ge=0)  # fragment rounds completed (SyncStats.ok_syncs, see live_values)
    failed_rounds: conint(strict=True, ge=0)
    alone_rounds: conint(strict=True, ge=0) = 0  # rounds in a row that averaged with no other peer
    land_steps: Optional[confloat(strict=True, ge=0.0)] = None  # SyncStats.mean_land_steps: how stale rounds land
    mode: Optional[constr(strict=True, max_length=32)]
    time: StrictFloat  # DHT time (seconds since the epoch) of this record

    class Config:
        extra = pydantic.Extra.forbid


FIELDS = tuple(PeerMetrics.__fields__)
_INT_FIELDS = ("step", "bytes_sent", "bytes_received", "rounds", "failed_rounds", "alone_rounds")
_FLOAT_FIELDS = ("loss", "tokens_per_s", "compute_utilization", "land_steps")


class MetricsSchema(pydantic.BaseModel):
    """The DHT schema of a run's metrics: ``{<public key>: PeerMetrics}`` under the key ``metrics``.

    Installed with ``prefix=run_prefix(run_id)``, the field ``metrics`` maps to the key
    ``run_key(run_id, "metrics")``. A module-level class: validators are pickled into the DHT process.
    """

    metrics: Dict[BytesWithPublicKey, Optional[PeerMetrics]]

    class Config:  # SchemaValidator sets Config.extra; without our own Config it would patch pydantic's base
        extra = pydantic.Extra.forbid


# host-side record of the key each DHT's process signs metrics records with
_SIGNING_KEYS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

def metrics_validators(run_id: str, private_key: Any = None) -> list:
    """The record validators of a run's metrics (schema + signature), for a DHT or a DHTNode."""
    return [SchemaValidator(MetricsSchema, prefix=run_prefix(run_id)), RSASignatureValidator(private_key)]


def install_validators(dht: Any, run_id: str, private_key: Any = None) -> bytes:
    """Install the run's metrics validators on ``dht``; return the public key used as this node's subkey.

    Writers and readers call it identically: a reader without them cannot even decode the signed
    records (its lookup of the key fails). A DHT signs with the first RSA key it was given (hivemind
    ignores later ones), so ``private_key`` only counts on the first call for a DHT; it defaults to
    hivemind's process-wide key. Tests running several nodes in one process pass distinct keys.
    """
    key = _SIGNING_KEYS.get(dht)
    if key is None:
        key = private_key if private_key is not None else RSAPrivateKey.process_wide()
        _SIGNING_KEYS[dht] = key
    validators = metrics_validators(run_id, key)
    dht.add_validators(validators)
    return validators[1].local_public_key


_DEFAULTS: dict[str, Any] = dict(step=0, bytes_sent=0, bytes_received=0, rounds=0, failed_rounds=0, alone_rounds=0,
                                 tokens_per_s=0.0, loss=None, compute_utilization=None, land_steps=None, mode=None)
_warned: set[str] = set()


def _coerce(key: str, value: Any) -> Any:
    if key in _INT_FIELDS:
        return max(0, int(value))
    if key not in _FLOAT_FIELDS:
        return str(value)[:32]  # mode
    value = float(value)
    if not math.isfinite(value):  # NaN is not equal to itself: the schema check would reject the record
        return _DEFAULTS[key]
    if key == "compute_utilization":
        return min(1.0, max(0.0, value))
    if key == "land_steps":
        return max(0.0, value)
    return max(0.0, value) if key == "tokens_per_s" else value


def live_values(stats: "SyncStats", **progress: Any) -> dict[str, Any]:
    """What a peer publishes: its sync counters (the one ``SyncStats`` record, under the schema's
    names: ``rounds`` are the syncs that produced an average, ``land_steps`` the inner steps they
    took to land on average) plus ``progress`` (step, loss,
    tokens_per_s, compute_utilization, mode)."""
    return {**progress, "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
            "rounds": stats.ok_syncs, "failed_rounds": stats.failed_syncs, "alone_rounds": stats.current_alone_streak,
            "land_steps": stats.mean_land_steps}


def to_record(values: dict[str, Any], *, name: str, peer_id: str, time: float) -> dict[str, Any]:
    """A schema-exact record from loosely typed ``values`` (numpy/torch numbers, NaN, extra keys).

    Keys that are not :class:`PeerMetrics` fields are ignored; a value that cannot be converted
    (e.g. a dict for ``rounds``) falls back to its default and is reported once as a warning,
    instead of losing the whole record.
    """
    out = dict(_DEFAULTS)
    for key in _DEFAULTS:
        if values.get(key) is None:
            continue
        try:
            out[key] = _coerce(key, values[key])
        except (TypeError, ValueError):
            if key not in _warned:
                _warned.add(key)
                kind = "an integer" if key in _INT_FIELDS else "a number" if key in _FLOAT_FIELDS else "a string"
                logger.warning("metrics field %r must be %s, got %r: published as %r", key, kind,
                               values[key], _DEFAULTS[key])
    out.update(name=str(name)[:64], peer_id=str(peer_id)[:128], time=float(time))
    return PeerMetrics(**out).dict()


class MetricsPublisher:
    """Publishes this peer's metrics to the DHT from a background thread; never raises into training.

    ``publish(values)`` only hands the latest values to the thread (a newer call replaces an
    unsent one), so a slow or broken DHT costs the training loop nothing. The thread re-stores the
    last record every ``expiration / 3`` seconds to keep it alive.
    """

    def __init__(self, dht: Any, run_id: str, expiration: float = 60.0, *, name: Optional[str] = None,
                 private_key: Any = None, store_timeout: Optional[float] = None):
        self.dht, self.run_id, self.expiration = dht, run_id, float(expiration)
        self.key = run_key(run_id, "metrics")
        self.public_key = install_validators(dht, run_id, private_key)
        self.peer_id = str(dht.peer_id)
        self.name = name or self.peer_id[-8:]
        self.store_timeout = store_timeout if store_timeout is not None else max(1.0, self.expiration / 3)
        self.published = 0  #: records the DHT accepted
        self.failures = 0  #: stores that failed or timed out
        self._pending: Optional[dict[str, Any]] = None
        self._last: Optional[dict[str, Any]] = None
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="metrics-publisher", daemon=True)
        self._thread.start()

    def publish(self, values: dict[str, Any]) -> None:
        """Queue ``values`` (keys of :class:`PeerMetrics`; others are ignored) for publication."""
        with self._cv:
            self._pending = dict(values)
            self._cv.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued values were stored (or failed); True if nothing is pending."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Store what is queued (waiting at most ``timeout``), then stop the thread.

        The last record stays on the DHT until it expires. A store still hanging after ``timeout``
        is abandoned (the thread is a daemon), so a dead DHT never delays a shutdown for long.
        """
        self.flush(timeout)
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(1.0)

    def __enter__(self) -> "MetricsPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._stopped, self.expiration / 3)
                if self._stopped:
                    return
                values = self._pending if self._pending is not None else self._last
            if values is None:
                continue
            ok = False
            try:
                now = get_dht_time()
                record = to_record(values, name=self.name, peer_id=self.peer_id, time=now)
                future = self.dht.store(self.key, record, expiration_time=now + self.expiration,
                                        subkey=self.public_key, return_future=True)
                ok = bool(future.result(timeout=self.store_timeout))
            except Exception as e:  # a DHT hiccup must never reach the training loop
                # said once, then quietly retried (at the next publish or refresh)
                logger.log(logging.DEBUG if self.failures else logging.WARNING, "metrics not published: %r", e)
            with self._cv:
                self.published += ok
                self.failures += not ok
                self._last = values
                if self._pending is values:
                    self._pending = None
                self._cv.notify_all()


def read_swarm_metrics(dht: Any, run_id: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The latest valid, unexpired record of every peer of the run, sorted by name.

    Each dict holds the :class:`PeerMetrics` fields plus ``expiration`` (DHT time). The caller's
    DHT must have the run's validators (:func:`install_validators`).
    """
    found = dht.get(run_key(run_id, "metrics"), latest=True, return_future=True).result(timeout=timeout)
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    records = []
    for item in found.value.values():
        if item.expiration_time < now or not isinstance(item.value, dict):
            continue
        records.append({**item.value, "expiration": item.expiration_time})
    return sorted(records, key=lambda r: (r.get("name") or "", r.get("peer_id") or ""))
