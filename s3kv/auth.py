"""The fleet secret: keyed MACs that tell objects the fleet wrote from forgeries.

Off by default. With a secret set (the environment variable
``S3KV_AUTH_KEY``, or the file named by the config key ``auth_key_file``),
every chunk object and manifest object a replica or ``s3kv gc`` writes
carries MACs, and a reader treats an object without a valid one as corrupt.
Several secrets, comma-separated, rotate keys: the first signs, every one
verifies. Each object names the key that signed it by a key id (a one-way
derivation of the secret), so a reader tries one key, not all.

The MAC is keyed BLAKE3 (the ``blake3`` package: a keyed hash several times
faster per core than HMAC-SHA256, so MACs do not bound a load), truncated to
128 bits, with a subkey per purpose derived from the secret
(``derive_key_context``), so a chunk's MAC can never pass for a manifest's.

Secrets never leave this module: not in reprs, logs, metrics or messages.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

import blake3

from s3kv.errors import ConfigError

ENV_VAR = "S3KV_AUTH_KEY"
MIN_SECRET_CHARS = 32
TAG_BYTES = 16
KID_BYTES = 8
PURPOSES = ("chunk", "manifest", "descriptor")
_CONTEXT = "s3kv 2026-12 {} v2"


class FleetKeys:
    """The fleet's secrets, as MAC keys. ``repr`` shows only counts and the
    signing key's id."""

    __slots__ = ("_keys", "key_file", "signing_kid")

    def __init__(self, secrets: Iterable[str]) -> None:
        keys: dict[bytes, dict[str, bytes]] = {}
        signing: bytes | None = None
        for secret in secrets:
            material = secret.encode("utf-8")
            kid = blake3.blake3(material, derive_key_context=_CONTEXT.format("key id")).digest(KID_BYTES)
            keys[kid] = {
                p: blake3.blake3(material, derive_key_context=_CONTEXT.format(p)).digest() for p in PURPOSES
            }
            signing = signing or kid
        if signing is None:
            raise ValueError("FleetKeys needs at least one secret")
        self._keys: Mapping[bytes, Mapping[str, bytes]] = keys
        self.signing_kid: bytes = signing
        self.key_file: str | None = None
        """The ``auth_key_file`` they were read from (None: another source).
        Then it named a file, not a secret pasted in place of its path."""

    def __repr__(self) -> str:
        return f"FleetKeys({len(self._keys)} key(s), signing key id {self.signing_kid.hex()})"

    __str__ = __repr__

    def __reduce__(self) -> object:  # never pickled across processes: each loads its own
        raise TypeError("FleetKeys cannot be pickled")

    def knows(self, kid: bytes) -> bool:
        return kid in self._keys

    def mac(self, purpose: str, kid: bytes, *parts: bytes | memoryview) -> bytes | None:
        """The MAC of ``parts`` under key ``kid`` (None: no such key)."""
        key = self._keys.get(kid)
        if key is None:
            return None
        h = blake3.blake3(key=key[purpose])
        for part in parts:
            h.update(part)
        return h.digest(TAG_BYTES)

    def sign(self, purpose: str, *parts: bytes | memoryview) -> bytes:
        tag = self.mac(purpose, self.signing_kid, *parts)
        assert tag is not None
        return tag

    def verify(self, purpose: str, kid: bytes, tag: bytes, *parts: bytes | memoryview) -> bool:
        expected = self.mac(purpose, kid, *parts)
        return expected is not None and hmac.compare_digest(expected, bytes(tag))


def parse_secrets(value: str, source: str) -> FleetKeys:
    """Comma-separated secrets, each at least ``MIN_SECRET_CHARS`` long.
    ``source`` names where they came from in errors (never the value)."""
    parts = [p.strip() for p in value.strip().split(",")]
    if not parts or any(not p for p in parts):
        raise ConfigError(f"{source}: empty fleet secret (secrets are comma-separated, none may be empty)")
    for i, p in enumerate(parts):
        if len(p) < MIN_SECRET_CHARS:
            which = f"secret {i + 1} of {len(parts)}" if len(parts) > 1 else "the fleet secret"
            raise ConfigError(
                f"{source}: {which} has {len(p)} characters; at least {MIN_SECRET_CHARS} are needed "
                "(e.g. `openssl rand -hex 32`)"
            )
    return FleetKeys(parts)


def load_keys(auth_key_file: str | None, environ: Mapping[str, str] | None = None) -> FleetKeys | None:
    """The fleet's keys from ``S3KV_AUTH_KEY`` (first) or ``auth_key_file``;
    None when neither is set. Raises ConfigError naming the problem."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR)
    if value is not None:
        return parse_secrets(value, ENV_VAR)
    if auth_key_file is None:
        return None
    path = Path(auth_key_file).expanduser()  # "~/.s3kv/key", as a shell would read it
    name = key_file_name(auth_key_file)
    try:
        st = path.stat()
        text = path.read_text("utf-8")
    except OSError as e:  # never the value: a pasted secret has a "/" one time in two (base64)
        raise ConfigError(
            f"auth_key_file (value not shown): cannot read it: {e.strerror or type(e).__name__} "
            "(it names a file holding the fleet secret, not the secret itself)"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: not UTF-8 text") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        import logging

        logging.getLogger("s3kv.auth").warning(
            "s3kv: %s is readable by other users (mode %o); chmod 600 it", name, st.st_mode & 0o777
        )
    keys = parse_secrets(text, name)
    keys.key_file = auth_key_file
    return keys


def key_file_name(value: str) -> str:
    """How messages name an ``auth_key_file`` that was read as a file: by
    its path, unless the value has no "/" (a name that may be the secret
    itself). A value that could not be read is never named."""
    return f"auth_key_file {value}" if "/" in value else "auth_key_file (value not shown)"
