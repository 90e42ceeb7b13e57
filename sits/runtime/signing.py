"""Signed healing commands: an HMAC-SHA256 over a record's key and value, named by a key id.

Only SITS may steer an engine. The decision (and the validator, for rollbacks)
signs every `HealingCommand` record it produces; the executor applies a command
read from Kafka only when its signature checks out against a key it knows. The
MAC covers the key id, the record key (the target) and the serialized command,
so nothing of the record that matters can be changed, and a signed command
cannot be moved to another target.

Two headers travel beside the CloudEvents ones:

    sits_signature_key   the key id, e.g. "2026-12"
    sits_signature       "hmac-sha256=" + the MAC in lower-case hex

Key files (one format for signers and verifiers): one key per line,
`<key id> <secret in base64>`, blank lines and `#` comments ignored; a secret
has at least 32 bytes. A signer signs with the FIRST key of its file; a
verifier accepts every key of its file. So keys rotate without downtime:
add the new key to the verifiers' files, then make it the signers' first key,
and drop the old key once no command it signed can still be in flight.
`KeyFile` re-reads a file when it changes (signers within a second, verifiers
at the next command), so none of this needs a restart.

Pure apart from reading key files: no Kafka, Redis or gRPC here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import secrets
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

KEY_ID_HEADER = "sits_signature_key"
SIGNATURE_HEADER = "sits_signature"
ALGORITHM = "hmac-sha256"
MIN_SECRET_BYTES = 32
KEY_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# Domain separation: this MAC means "a SITS healing command", nothing else signed with the same key.
_DOMAIN = b"sits.healing-command.v1\x00"
_PREFIX = f"{ALGORITHM}=".encode()
_HEX_LENGTH = hashlib.sha256().digest_size * 2

Header = tuple[str, bytes]


class KeyFileError(ValueError):
    """A key file is missing, unreadable or malformed; the message names the file and line, never a secret."""


class SignatureError(ValueError):
    """A record's signature does not hold; `category` is a short label (unsigned, unknown_key, bad_signature)."""

    def __init__(self, category: str, reason: str) -> None:
        super().__init__(reason)
        self.category = category


@dataclass(frozen=True, slots=True)
class SigningKey:
    key_id: str
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not KEY_ID_PATTERN.match(self.key_id):
            raise KeyFileError(f"key id {self.key_id!r} must match {KEY_ID_PATTERN.pattern}")
        if len(self.secret) < MIN_SECRET_BYTES:
            raise KeyFileError(f"key {self.key_id!r} has {len(self.secret)} bytes; at least {MIN_SECRET_BYTES}")


def parse_keys(text: str, source: str = "key file") -> tuple[SigningKey, ...]:
    """The keys of a key file's text, in file order; KeyFileError names the bad line."""
    keys: list[SigningKey] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(f"{source} line {number}: expected '<key id> <base64 secret>'")
        key_id, encoded = parts
        try:
            secret = base64.b64decode(encoded + "=" * (-len(encoded) % 4), altchars=b"-_", validate=False)
        except (binascii.Error, ValueError) as err:
            raise KeyFileError(f"{source} line {number}: the secret of {key_id!r} is not base64") from err
        if key_id in seen:
            raise KeyFileError(f"{source} line {number}: key id {key_id!r} appears twice")
        try:
            keys.append(SigningKey(key_id, secret))
        except KeyFileError as err:
            raise KeyFileError(f"{source} line {number}: {err}") from None
        seen.add(key_id)
    if not keys:
        raise KeyFileError(f"{source} holds no key")
    return tuple(keys)


def read_keys(path: Path) -> tuple[SigningKey, ...]:
    try:
        text = path.read_text()
    except OSError as err:
        raise KeyFileError(f"cannot read key file {path}: {err.strerror or err}") from None
    return parse_keys(text, str(path))


def new_key(key_id: str) -> SigningKey:
    return SigningKey(key_id, secrets.token_bytes(MIN_SECRET_BYTES))


def key_line(key: SigningKey) -> str:
    return f"{key.key_id} {base64.urlsafe_b64encode(key.secret).decode().rstrip('=')}"


def write_key_file(path: Path, keys: Sequence[SigningKey]) -> None:
    """Write `keys` (the signing one first) readable by the owner only, replacing the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write("# SITS command keys: '<key id> <base64 secret>'; the first one signs.\n")
        handle.writelines(f"{key_line(key)}\n" for key in keys)
    os.replace(temporary, path)


def _message(key_id: bytes, record_key: bytes, value: bytes) -> bytes:
    return b"".join(
        (_DOMAIN, struct.pack(">H", len(key_id)), key_id, struct.pack(">I", len(record_key)), record_key, value)
    )


def mac(key: SigningKey, record_key: bytes, value: bytes) -> bytes:
    return hmac.digest(key.secret, _message(key.key_id.encode(), record_key, value), "sha256")


KeySource = Callable[[], Sequence[SigningKey]]


class Signer:
    """Signs records with the first key its source gives (a KeyFile re-reads on change)."""

    def __init__(self, keys: KeySource | Sequence[SigningKey]) -> None:
        self._keys: KeySource = keys if callable(keys) else _fixed(keys)

    @property
    def key_id(self) -> str:
        return self._keys()[0].key_id

    def headers(self, record_key: bytes, value: bytes) -> list[Header]:
        key = self._keys()[0]
        return [
            (KEY_ID_HEADER, key.key_id.encode()),
            (SIGNATURE_HEADER, _PREFIX + mac(key, record_key, value).hex().encode()),
        ]


class Verifier:
    """Checks a record's signature against every key its source gives."""

    def __init__(self, keys: KeySource | Sequence[SigningKey]) -> None:
        self._keys: KeySource = keys if callable(keys) else _fixed(keys)
        self._refresh: Callable[[], object] | None = getattr(keys, "refresh", None)
        self._seen: Sequence[SigningKey] | None = None
        self._by_id: dict[bytes, SigningKey] = {}

    def key_ids(self) -> list[str]:
        return [k.key_id for k in self._keys()]

    def _ring(self) -> dict[bytes, SigningKey]:
        keys = self._keys()
        if keys is not self._seen:
            self._by_id = {k.key_id.encode(): k for k in keys}
            self._seen = keys
        return self._by_id

    def verify(self, headers: Iterable[Header], record_key: bytes, value: bytes) -> str:
        """The id of the key that signed the record; SignatureError with the reason otherwise."""
        key_id: bytes | None = None
        signature: bytes | None = None
        for name, header in headers:
            if name == KEY_ID_HEADER:
                if key_id is not None:
                    raise SignatureError("bad_signature", f"header {KEY_ID_HEADER} appears twice")
                key_id = header
            elif name == SIGNATURE_HEADER:
                if signature is not None:
                    raise SignatureError("bad_signature", f"header {SIGNATURE_HEADER} appears twice")
                signature = header
        if key_id is None and signature is None:
            raise SignatureError("unsigned", f"no signature (headers {KEY_ID_HEADER}, {SIGNATURE_HEADER})")
        if key_id is None or signature is None:
            missing = KEY_ID_HEADER if key_id is None else SIGNATURE_HEADER
            raise SignatureError("bad_signature", f"header {missing} is missing")
        key = self._ring().get(key_id)
        if key is None and self._refresh is not None:
            self._refresh()  # a key added to the file since the last check
            key = self._ring().get(key_id)
        shown = key_id.decode(errors="replace")[:64]
        if key is None:
            raise SignatureError("unknown_key", f"signed with unknown key id {shown!r}")
        if not signature.startswith(_PREFIX) or len(signature) != len(_PREFIX) + _HEX_LENGTH:
            raise SignatureError("bad_signature", f"header {SIGNATURE_HEADER} is not '{ALGORITHM}=<hex>'")
        expected = _PREFIX + mac(key, record_key, value).hex().encode()
        if not hmac.compare_digest(expected, signature.lower()):
            raise SignatureError("bad_signature", f"signature does not match key {shown!r}")
        return key.key_id


def _fixed(keys: Sequence[SigningKey]) -> KeySource:
    frozen = tuple(keys)
    if not frozen:
        raise KeyFileError("no key given")
    return lambda: frozen


class KeyFile:
    """A key file, re-read when it changes (checked at most every `recheck_s`, and on `refresh()`).

    A file that turns unreadable or malformed keeps the keys last read (logged once per
    change): a half-written file must not stop signing or verifying. Kubernetes swaps a
    mounted Secret by symlink; the stat follows it.
    """

    def __init__(self, path: Path, *, recheck_s: float = 1.0, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._recheck_s = recheck_s
        self._monotonic = monotonic
        self._stamp = self._stat()
        self._keys = read_keys(path)  # a bad file at start is an error, not a warning
        self._checked_at = monotonic()
        self.reloads = 0

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return (stat.st_ino, stat.st_dev, stat.st_mtime_ns, stat.st_size)

    def __call__(self) -> tuple[SigningKey, ...]:
        now = self._monotonic()
        if now - self._checked_at >= self._recheck_s:
            self._checked_at = now
            self._reload_if_changed()
        return self._keys

    def refresh(self) -> tuple[SigningKey, ...]:
        """Check the file now (a verifier does this on an unknown key id)."""
        self._checked_at = self._monotonic()
        self._reload_if_changed()
        return self._keys

    def _reload_if_changed(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            keys = read_keys(self.path)
        except KeyFileError as err:
            log.warning("keeping the keys last read: %s", err)
            return
        if [k.key_id for k in keys] != [k.key_id for k in self._keys]:
            log.info("key file %s now holds key ids %s", self.path, [k.key_id for k in keys])
        self._keys = keys
        self.reloads += 1


def file_signer(path: Path | None) -> Signer | None:
    """A signer on the first key of `path` (re-read on change), or None when no file is configured."""
    return None if path is None else Signer(KeyFile(path))


def file_verifier(path: Path | None) -> Verifier | None:
    """A verifier on every key of `path`, or None when no file is configured.

    The file is checked (one stat, microseconds) at every verification: a key removed from it,
    retired or compromised, is refused from the next command on.
    """
    return None if path is None else Verifier(KeyFile(path, recheck_s=0.0))
