"""Authenticated encryption of the direct data path (``direct.py``): AES-256-GCM on every message.

Without it, anyone on the path between two groupmates could read every outer gradient and rewrite a
contribution or a reduced part in flight. Sealed, a message that was altered, replayed, reordered,
dropped or written by someone without the keys fails to open (:class:`SealError`), which fails the
exchange with that peer through the round's usual failure path: nothing it carried is averaged.

*Keys.* Each connection has two keys, one per direction, drawn with HKDF-SHA256 from:

- the group secret: the group id (drawn by the leader; members learn it only over hivemind's
  authenticated, encrypted streams) and, in a run with a run key, an HMAC of the group id under
  that key, so that a leak of a group id alone does not open a keyed run's bytes;
- a salt: 16 random bytes the sender draws (``os.urandom``, distinct in every process) for this
  connection and sends in its hello;
- the prefix (run and fragment), the sender's and the reducer's index in the group and the
  direction (``to-reducer``: contributions and verdict; ``to-sender``: results).

*Nonces.* 96 bits: four zero bytes and a 64-bit message counter that starts at 0 for each key and
only goes up (:class:`Sealer` refuses to wrap it). The counter is not sent: each side counts the
messages it has opened, so a message out of place opens under the wrong nonce and fails.

*Associated data.* The message's length field, so a length cannot be changed either.

``DirectSecurity(plaintext=True)`` turns sealing off (``--direct-plaintext``): for measuring what it
costs only. A sealed and a plaintext peer refuse each other's connections (the hello says which).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Any, Optional, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from opendiloco_stream.transport.hivemind.protocol import ProtocolError

TAG_BYTES = 16  # what sealing adds to a message
SALT_BYTES = 16
KEY_LABEL = b"ods-direct-seal-v2\0"
TO_REDUCER, TO_SENDER = b"to-reducer", b"to-sender"
_MAX_COUNTER = (1 << 64) - 1


class SealError(ProtocolError):
    """A direct message that does not open: altered, replayed, out of order, or sealed under other keys."""


def derive_key(secret: bytes, salt: bytes, prefix: str, sender: int, reducer: int, direction: bytes) -> bytes:
    """The AES-256 key of one direction of one connection (see the module docstring)."""
    info = KEY_LABEL + prefix.encode() + b"\0" + struct.pack("<HH", sender, reducer) + direction
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(secret)


def nonce(counter: int) -> bytes:
    return bytes(4) + counter.to_bytes(8, "little")


class Sealer:
    """Seals the messages of one direction of one connection, in order (one key, one counter)."""

    def __init__(self, key: bytes):
        self._key, self._counter = key, 0

    def _next_nonce(self) -> bytes:
        if self._counter > _MAX_COUNTER:  # 2^64 messages: never in practice, and never a nonce twice
            raise SealError("direct connection sealed 2^64 messages: its nonces are used up")
        self._counter += 1
        return nonce(self._counter - 1)

    def seal(self, parts: Sequence[Any], aad: bytes) -> list:
        """The ciphertext of the concatenation of ``parts`` (buffers, encrypted one after the other
        without joining them), then the tag: ``sum(len(parts)) + TAG_BYTES`` bytes in all."""
        encryptor = Cipher(algorithms.AES(self._key), modes.GCM(self._next_nonce())).encryptor()
        encryptor.authenticate_additional_data(aad)
        out = [encryptor.update(part) for part in parts if len(part)]
        encryptor.finalize()
        return [*out, encryptor.tag]


class Opener:
    """Opens the messages of one direction of one connection, in the order they were sealed."""

    def __init__(self, key: bytes):
        self._aead, self._counter = AESGCM(key), 0

    def open(self, data: Any, aad: bytes) -> bytes:
        """The plaintext of ``data`` (ciphertext and tag); ``SealError`` if it does not open."""
        try:
            plain = self._aead.decrypt(nonce(self._counter), bytes(data) if isinstance(data, memoryview) else data, aad)
        except InvalidTag:
            raise SealError(f"direct message {self._counter} does not open (altered, replayed, out of order or "
                            f"sealed under other keys)") from None
        self._counter += 1
        return plain


class Channel:
    """One end of a sealed connection: ``sealer`` for what this end writes, ``opener`` for what it reads."""

    def __init__(self, sealer: Sealer, opener: Opener):
        self.sealer, self.opener = sealer, opener


class DirectSecurity:
    """How one fragment endpoint protects its direct connections: sealed (the default) or plaintext
    (measuring only), and the run key's part in the keys (``auth``: a ``net.auth.RunAuth``, or None)."""

    def __init__(self, plaintext: bool = False, auth: Optional[Any] = None):
        self.plaintext, self.auth = bool(plaintext), auth

    def group_secret(self, group_id: bytes) -> bytes:
        """What keys and hello MACs of a group derive from: its id, and the run key when there is one."""
        return bytes(group_id) + (b"" if self.auth is None else self.auth.mac("direct", bytes(group_id)))

    def hello_mac(self, group_id: bytes, prefix: str, sender: int, reducer: int, flags: int, salt: bytes) -> bytes:
        msg = b"ods-direct-v2\0" + prefix.encode() + b"\0" + struct.pack("<HHB", sender, reducer, flags) + salt
        return hmac.new(self.group_secret(group_id), msg, hashlib.sha256).digest()

    def channel(self, group_id: bytes, prefix: str, sender: int, reducer: int, salt: bytes,
                side: str) -> Optional[Channel]:
        """This end's channel (``side``: ``"sender"`` or ``"reducer"``); None in plaintext mode."""
        if self.plaintext:
            return None
        secret = self.group_secret(group_id)
        to_reducer, to_sender = (derive_key(secret, salt, prefix, sender, reducer, d) for d in (TO_REDUCER, TO_SENDER))
        if side == "sender":
            return Channel(Sealer(to_reducer), Opener(to_sender))
        if side == "reducer":
            return Channel(Sealer(to_sender), Opener(to_reducer))
        raise ValueError(f"side must be 'sender' or 'reducer', got {side!r}")


def new_salt() -> bytes:
    """A connection's salt: from the kernel, so no two processes ever draw the same one."""
    return os.urandom(SALT_BYTES)
