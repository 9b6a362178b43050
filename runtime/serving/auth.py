"""API keys and tenants of `kvexport serve --api-keys FILE`: this module owns the key file's
format, the lookup of a request's bearer key, and the ASGI middleware that refuses requests
without a valid key (OpenAI's 401 body) and hands the key's tenant to the routes.

    Authorization: Bearer KEY ──HMAC-SHA256(process secret, KEY)──▶ dict lookup ──▶ tenant | 401
                                                                                   │
    request scope[TENANT_SCOPE_KEY] ◀──────────────────────────────────────────────┘
        └─▶ server.py: block_hash.request_salt(tenant, body.cache_salt) ─▶ every prefix-cache key

The key file: one `KEY TENANT` pair a line (whitespace between), `#` comment lines and blank
lines allowed. A key is 16 to 1024 visible ASCII characters (it travels in an HTTP header);
a tenant is any run of non-space characters (at most 256). Several keys may name one
tenant (rotation: both keys work, and they share the tenant's cache); a key may appear once.
Every mistake is a `ApiKeyFileError` naming --api-keys, the file and the line; no message,
log line or repr ever holds a key.

Every path needs a key except OPEN_PATHS (/health for load balancers, /metrics for
Prometheus: neither carries a prompt, a completion or a per-tenant figure); so a route added
later is protected without anyone remembering to. vLLM's --api-key guards /v1 only.

NOTE (constant time): keys are not compared one by one. At load every key is replaced by its
HMAC-SHA256 under a secret drawn per process, and a request's key is looked up by its own
digest in a dict. The time of that lookup depends on the digest, which no client can choose
or predict without the secret, and not on how many leading characters of some key it got
right; the HMAC's time depends only on the length of what was sent. (Comparing with
hmac.compare_digest against every key also hides the matching key, at O(keys) per request.)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from starlette.responses import JSONResponse

from kvexport.errors import ConfigError

from .key_files import load_key_file
from .openai_protocol import ApiError


KEYS_ENV = "KVEXPORT_API_KEYS"  # names the key file when --api-keys is not given
OPTION = f"--api-keys (or ${KEYS_ENV})"  # how messages name the setting
MIN_KEY_CHARS = 16  # shorter keys are refused: guessable (e.g. `openssl rand -hex 32` makes 64)
MAX_KEY_CHARS = 1024
MAX_TENANT_CHARS = 256
MAX_FILE_BYTES = 16 << 20  # a key file above this is refused (it is read whole, at start)
OPEN_PATHS = frozenset({"/health", "/metrics"})  # the only paths served without a key
TENANT_SCOPE_KEY = "kvexport.tenant"  # the ASGI scope entry that carries the tenant to the routes


class ApiKeyFileError(ConfigError):
    """The --api-keys file cannot be read, holds no key, or has a malformed or repeated line."""


class ApiKeys:
    """The keys of one key file: `tenant(key)` -> the key's tenant, or None. Holds no key
    itself, only their HMAC digests under a secret of this process."""

    def __init__(self, pairs: list[tuple[str, str]], source: str = "<keys>"):
        """`pairs`: (key, tenant), already checked (`parse`); `source`: the file, for messages."""
        self._secret = secrets.token_bytes(32)
        self._tenants: dict[bytes, str] = {self._digest(k.encode("ascii")): t for k, t in pairs}
        self.source = source
        assert len(self._tenants) == len(pairs), "parse() refuses repeated keys"

    def _digest(self, key: bytes) -> bytes:
        return hmac.new(self._secret, key, hashlib.sha256).digest()

    def tenant(self, key: str | bytes | None) -> str | None:
        """The tenant of `key`, or None for no key or an unknown one (timing: see the module's NOTE)."""
        if key is None:
            return None
        raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
        return self._tenants.get(self._digest(raw))

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self._tenants.values())

    def __len__(self) -> int:
        return len(self._tenants)

    def __repr__(self) -> str:  # NOTE: no digests either: nothing of a key is ever printed
        return f"ApiKeys({len(self)} keys, {len(self.tenants)} tenants, from {self.source})"

    # ---- the key file -------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, source: str = "<keys>") -> "ApiKeys":
        """The key file's text -> ApiKeys; ApiKeyFileError naming the line for any mistake."""
        def bad(line_no: int, what: str) -> ApiKeyFileError:
            return ApiKeyFileError(f"{OPTION} {source}, line {line_no}: {what}; each line is `KEY TENANT` "
                                   f"(blank lines and lines starting with # are skipped)")

        pairs: list[tuple[str, str]] = []
        first_line: dict[str, int] = {}
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) != 2:
                raise bad(n, f"expected 2 fields (a key and a tenant), got {len(fields)}")
            key, tenant = fields
            if not all(0x21 <= ord(c) <= 0x7E for c in key):
                raise bad(n, "the key must be visible ASCII characters (it is sent in an HTTP header)")
            if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
                raise bad(n, f"the key has {len(key)} characters; use {MIN_KEY_CHARS} to {MAX_KEY_CHARS} "
                             f"(e.g. `openssl rand -hex 32`)")
            if len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
                raise bad(n, f"the tenant must be at most {MAX_TENANT_CHARS} printable characters")
            if key in first_line:
                raise bad(n, f"repeats the key of line {first_line[key]} (each key may appear once; several "
                             f"keys may name one tenant)")
            first_line[key] = n
            pairs.append((key, tenant))
        if not pairs:
            raise ApiKeyFileError(f"{OPTION} {source} holds no keys: write one `KEY TENANT` line per key")
        return cls(pairs, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ApiKeys":
        """Read and parse the key file at `path`; ApiKeyFileError if it is unreadable or wrong.
        Warns when other users may read it (it should be chmod 600)."""
        return load_key_file(path, OPTION, ApiKeyFileError, MAX_FILE_BYTES, cls.parse)


# ---- HTTP ----------------------------------------------------------------------------------
def bearer_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key of an `Authorization: Bearer KEY` header (scheme in any case), or None (no such
    header, or a malformed one: `authorization_sent` tells which)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, key = value.strip().partition(b" ")
            return (key.strip() or None) if scheme.lower() == b"bearer" else None
    return None


def authorization_sent(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request has an Authorization header at all (well-formed or not)."""
    return any(name.lower() == b"authorization" for name, _ in headers)


def unauthorized(key_sent: bool, malformed: bool = False) -> tuple[ApiError, dict[str, str]]:
    """OpenAI's 401 (type invalid_request_error, code invalid_api_key) and its WWW-Authenticate
    header (RFC 6750): for a wrong key, a malformed Authorization header (`Bearer<TAB>KEY`,
    `Bearer` alone, `Basic ...`) or none. NOTE: unlike OpenAI's, the message never repeats any
    part of the header."""
    if key_sent:
        return (ApiError(401, "Incorrect API key provided. Ask this server's operator for a key.",
                         code="invalid_api_key"), {"WWW-Authenticate": 'Bearer error="invalid_token"'})
    if malformed:
        return (ApiError(401, "The Authorization header is malformed: send `Authorization: Bearer YOUR_KEY` (the "
                              "word Bearer, a space, then the key; other schemes such as Basic are not taken).",
                         code="invalid_api_key"), {"WWW-Authenticate": 'Bearer error="invalid_request"'})
    return (ApiError(401, "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                          "(Authorization: Bearer YOUR_KEY).", code="invalid_api_key"),
            {"WWW-Authenticate": "Bearer"})


class ApiKeyAuth:
    """ASGI middleware: a request to any path but OPEN_PATHS needs a valid bearer key, or gets a
    401 before any route (or the body limit) reads its body; a valid one's tenant goes into
    the scope under TENANT_SCOPE_KEY (`tenant_of`)."""

    def __init__(self, app, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:  # lifespan passes
            return await self.app(scope, receive, send)
        key = bearer_key(scope["headers"])
        tenant = self.keys.tenant(key)
        if tenant is None:
            if scope["type"] == "websocket":  # no route takes one today; refused all the same (policy violation)
                return await send({"type": "websocket.close", "code": 1008})
            err, headers = unauthorized(key is not None, malformed=authorization_sent(scope["headers"]))
            return await JSONResponse(err.body(), status_code=401, headers=headers)(scope, receive, send)
        scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


def tenant_of(scope: dict) -> str | None:
    """The tenant ApiKeyAuth found for this request (None: the server takes no keys)."""
    return scope.get(TENANT_SCOPE_KEY)
