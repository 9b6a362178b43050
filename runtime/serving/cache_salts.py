"""Which prefix-cache salt a request gets: the one rule every front end applies (`kvexport serve`,
the Dynamo worker, the Triton model; the Python API's caller is the operator and is trusted).

    the request's salt field(s) ──one salt (fields that disagree: refused)──▶ requests.check_cache_salt
        (a non-empty string, at most 1024 characters, valid Unicode; else refused naming the field)
      ──without a salt key: taken as sent
      ──with a salt key (--cache-salt-key FILE / $KVEXPORT_CACHE_SALT_KEY): only a salt the gateway
        signed (`TENANT.SIG`), and never none; anything else refused
      ──▶ block_hash.request_salt(tenant, salt) ──▶ every prefix-cache key of the request

A salt is what keeps one tenant's cached prefixes from another's behind a gateway (only
`kvexport serve --api-keys` knows tenants itself), so a client must not be able to choose it.
"Trust field X" cannot be enforced on a worker: Dynamo 1.6.1's frontend merges a client's
`cache_salt` and `nvext.cache_salt` into one value before the worker sees it (`nvext` wins:
a gateway that sets `cache_salt` loses to a client's `nvext.cache_salt`) and forwards no
header. So the rule trusts the signer instead: with a salt key, the gateway sends
`TENANT.SIG`, SIG = hex HMAC-SHA256(key, TENANT), and the server refuses every salt not signed
with one of its keys, and every request without a salt. Whatever field a client fills, with
whatever value, it gets the salt its gateway signed or a 400: tenant names may be public, the
key is the secret (shared by the gateway and the servers only; signed salts are never echoed).

The key file: one key a line (the first signs: `sign`; every one verifies, for rotation),
`#` lines and blank lines skipped; a key is 32 to 1024 visible ASCII characters (e.g.
`openssl rand -hex 32`). Mistakes are a `SaltKeyError` naming the option, the file and the
line, never a key. The gateway's side in a shell:
`printf %s "$TENANT" | openssl dgst -sha256 -hmac "$KEY" -r | cut -d' ' -f1`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from typing import Any

from kvexport.errors import ConfigError

from .key_files import load_key_file
from .requests import MAX_CACHE_SALT_CHARS, RequestError, check_cache_salt


SALT_KEY_ENV = "KVEXPORT_CACHE_SALT_KEY"  # names the key file where --cache-salt-key is not given (Triton: only)
OPTION = f"--cache-salt-key (or ${SALT_KEY_ENV})"  # how messages name the setting
MIN_KEY_CHARS = 32  # shorter keys are refused (guessable); `openssl rand -hex 32` makes 64
MAX_KEY_CHARS = 1024
MAX_FILE_BYTES = 1 << 20
SIG_CHARS = 64  # hex digits of an HMAC-SHA256
# characters of a signed salt's tenant part at most: the whole salt fits check_cache_salt's limit
MAX_TENANT_CHARS = MAX_CACHE_SALT_CHARS - SIG_CHARS - 1


class SaltKeyError(ConfigError):
    """The salt key file cannot be read, holds no key, or has a malformed line."""


def one_salt(fields: Sequence[tuple[str, Any]]) -> str | None:
    """The one salt a request carries in `fields` ((field name, value or None), every place the
    front end reads a salt from): each checked (requests.check_cache_salt), and those given must be
    equal; None when none is given. Raises RequestError naming the field(s); never repeats a salt."""
    given = [(name, check_cache_salt(value, name)) for name, value in fields if value is not None]
    if len({v for _, v in given}) > 1:
        names = " and ".join(name for name, _ in given)
        raise RequestError(f"{names} disagree: a request carries one prefix-cache salt; send it in one field "
                           f"(or the same value in each)", given[0][0], code="conflicting_cache_salt")
    return given[0][1] if given else None


class SaltKey:
    """The keys of one salt key file: `sign(tenant)` (the gateway's side) and `check(salt)` (the
    server's). Never prints a key (repr, messages)."""

    def __init__(self, keys: Sequence[str], source: str = "<key>"):
        """`keys`: already checked (`parse`); the first signs. `source`: the file, for messages."""
        assert keys, "parse() refuses a file without keys"
        self._keys = tuple(k.encode("ascii") for k in keys)
        self.source = source

    def __repr__(self) -> str:
        return f"SaltKey({len(self._keys)} key(s), from {self.source})"

    @staticmethod
    def _sig(key: bytes, tenant: str) -> str:
        return hmac.new(key, tenant.encode("utf-8"), hashlib.sha256).hexdigest()

    def sign(self, tenant: str) -> str:
        """The salt a gateway sends for `tenant` (1 to MAX_TENANT_CHARS characters): `TENANT.SIG`."""
        if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
            raise ConfigError(f"a tenant is 1 to {MAX_TENANT_CHARS} characters, got {tenant!r}")
        return f"{tenant}.{self._sig(self._keys[0], tenant)}"

    def check(self, salt: str | None, param: str = "cache_salt") -> str:
        """`salt` (already checked by check_cache_salt, or None) if one of the keys signed it; else
        RequestError naming `param` (code `invalid_cache_salt`), which never repeats the salt."""
        why = (f"this server takes only prefix-cache salts its gateway signed ({OPTION} on the server); "
               f"send the request through the gateway")
        if salt is None:
            raise RequestError(f"{param}: missing; {why}", param, code="invalid_cache_salt")
        tenant, _, sig = salt.rpartition(".")
        # NOTE: every key is compared, in constant time, whatever matched: the time says nothing of the key
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(self._sig(key, tenant).encode(), sig.encode("utf-8", "surrogatepass"))
        if not tenant or not ok:
            raise RequestError(f"{param}: not signed with this server's salt key; {why}", param,
                               code="invalid_cache_salt")
        return salt

    # ---- the key file -----------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, source: str = "<key>") -> "SaltKey":
        """The key file's text -> SaltKey; SaltKeyError naming the line for any mistake."""
        keys: list[str] = []
        for n, line in enumerate(text.splitlines(), 1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            where = f"{OPTION} {source}, line {n}"
            if not all(0x21 <= ord(c) <= 0x7E for c in key):
                raise SaltKeyError(f"{where}: a key is one run of visible ASCII characters (one key a line)")
            if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
                raise SaltKeyError(f"{where}: the key has {len(key)} characters; use {MIN_KEY_CHARS} to "
                                   f"{MAX_KEY_CHARS} (e.g. `openssl rand -hex 32`)")
            keys.append(key)
        if not keys:
            raise SaltKeyError(f"{OPTION} {source} holds no key: write one (e.g. `openssl rand -hex 32 > {source}`)")
        return cls(keys, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SaltKey":
        """Read and parse the key file at `path`; SaltKeyError if it is unreadable or wrong. Warns
        when other users may read it (it should be chmod 600)."""
        return load_key_file(path, OPTION, SaltKeyError, MAX_FILE_BYTES, cls.parse)

    @classmethod
    def from_env(cls) -> "SaltKey | None":
        """The key file named by $KVEXPORT_CACHE_SALT_KEY, loaded, or None when it is unset or empty."""
        path = os.environ.get(SALT_KEY_ENV)
        return cls.load(path) if path else None


def accept_salt(fields: Sequence[tuple[str, Any]], key: SaltKey | None) -> str | None:
    """The rule: the request's one salt (`one_salt`), and with `key` only a salt it signed (never none).
    Returns the salt as block_hash.request_salt takes it; raises RequestError naming the field."""
    salt = one_salt(fields)
    return salt if key is None else key.check(salt, fields[0][0])
