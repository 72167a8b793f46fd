"""Who may call what: API keys, tenants and the admin key.

``--api-key`` is one key, or a file of ``key tenant`` lines (``load_api_keys``);
``--admin-api-key`` (SGLang's flag) is the admin's. ``ApiKeyMiddleware`` turns the key a
request presents into a ``Caller``; the routes ask it (``require_admin``,
``require_server_wide``). The rules, SGLang's where SGLang has tenants' equivalent:

- no key set: every route is open, every caller is the admin (as SGLang);
- admin routes (weight updates, ``/flush_cache``, ``abort_all``, ``/metrics``) take the
  admin key; without ``--admin-api-key`` the one ``--api-key`` key is the admin (SGLang's
  ``ADMIN_OPTIONAL``), and a tenant key never is: a server with a key file and no admin
  key refuses admin routes to everyone (403 naming ``--admin-api-key``);
- the other routes take any key (the admin key too); with ``--admin-api-key`` alone they
  are open, as in SGLang;
- server-wide views (``/get_load``, ``/v1/loads``, ``/get_server_info``'s full form) go
  to every caller but a tenant: they count every tenant's traffic;
- ``/health`` is always open.

Keys are compared as SHA-256 digests, so the lookup time says nothing about a key.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.http_utils import json_response
from radixlm.runtime.managers.api_error import ApiError

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # reachable without any key
TENANT_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
ADMIN_FLAG = "--admin-api-key"


@dataclass(frozen=True)
class Caller:
    """Whose key a request presented. ``kind``: ``admin``, ``tenant``, ``user`` (the one
    ``--api-key`` key while an admin key is set) or ``anonymous`` (no key needed)."""

    kind: str
    tenant: str | None = None
    admin_key_set: bool = False

    @property
    def admin(self) -> bool:
        return self.kind == "admin"


NO_KEYS = Caller("admin")  # a server without keys: everyone may do everything


def load_api_keys(api_key: str) -> dict[bytes, str | None]:
    """``--api-key``: one key (tenant ``None``), or the path of a file of ``key tenant``
    lines (``#`` comments and blank lines allowed) whose keys each name their tenant.
    Returns ``{sha256(key): tenant}``; ValueError names the line of a bad file."""
    if not os.path.isfile(api_key):
        return {_digest(api_key.encode()): None}
    keys: dict[bytes, str | None] = {}
    with open(api_key, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            where = f"{api_key}:{lineno}"
            if len(fields) != 2:
                raise ValueError(f"{where}: want 'key tenant', got {len(fields)} fields")
            key, tenant = fields
            if not TENANT_NAME.fullmatch(tenant):
                raise ValueError(f"{where}: tenant names are 1-64 of [A-Za-z0-9_.-], "
                                 f"got {tenant!r}")
            digest = _digest(key.encode())
            if digest in keys:
                raise ValueError(f"{where}: this key is listed twice")
            keys[digest] = tenant
    if not keys:
        raise ValueError(f"{api_key}: no 'key tenant' lines")
    return keys


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The server's keys: ``{digest: tenant}`` of ``--api-key`` and the admin's digest."""

    def __init__(self, keys: dict[bytes, str | None], admin: bytes | None) -> None:
        if admin is not None and admin in keys:
            raise ValueError(f"{ADMIN_FLAG} must differ from every --api-key key")
        self.keys, self.admin = keys, admin

    @classmethod
    def from_args(cls, args: ServerArgs) -> ApiKeys | None:
        """None when no key is set (ValueError for a bad key file)."""
        if not args.api_key and not args.admin_api_key:
            return None
        keys = load_api_keys(args.api_key) if args.api_key else {}
        admin = _digest(args.admin_api_key.encode()) if args.admin_api_key else None
        return cls(keys, admin)

    def caller(self, key: bytes) -> Caller | None:
        """The caller presenting ``key`` (b"" for none); None: refused (401)."""
        digest, admin_set = _digest(key), self.admin is not None
        if digest == self.admin:
            return Caller("admin", None, True)
        if digest in self.keys:
            tenant = self.keys[digest]
            kind = "tenant" if tenant is not None else "user" if admin_set else "admin"
            return Caller(kind, tenant, admin_set)
        if not self.keys:  # --admin-api-key alone: the other routes stay open (SGLang)
            return Caller("anonymous", None, True)
        return None


class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (or ``X-API-Key``) is a key of ``keys``
    (or none is needed); the ``Caller`` goes to the request's state (``request_caller``)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            key = (token.strip() if scheme.lower() == b"bearer"  # RFC 9110: any case
                   else headers.get(b"x-api-key", b""))
            caller = self.keys.caller(key)
            if caller is None:
                err = ApiError(
                    401,
                    "invalid or missing API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key",
                )
                await json_response(err.body(), 401)(scope, receive, send)
                return
            state = scope.setdefault("state", {})
            state["caller"], state["tenant"] = caller, caller.tenant
        await self.app(scope, receive, send)


def with_api_keys(app: ASGIApp, args: ServerArgs) -> ASGIApp:
    """``app`` behind ``ApiKeyMiddleware`` when a key is set."""
    keys = ApiKeys.from_args(args)
    if keys is None:
        return app
    if keys.admin is None and any(t is not None for t in keys.keys.values()):
        logger.warning("tenant keys and no %s: the admin routes (weight updates, "
                       "/flush_cache, abort_all, /metrics) are refused to everyone", ADMIN_FLAG)
    return ApiKeyMiddleware(app, keys)


def request_caller(request: Request) -> Caller:
    """Whose key ``request`` presented (``NO_KEYS`` on a server without keys)."""
    return request.scope.get("state", {}).get("caller", NO_KEYS)


def request_tenant(request: Request) -> str | None:
    """The tenant whose key authenticated ``request`` (None: no tenants)."""
    return request_caller(request).tenant


def require_admin(request: Request, what: str) -> None:
    """401/403 unless ``request`` holds the admin key; ``what`` names the refused thing."""
    caller = request_caller(request)
    if caller.admin:
        return
    if caller.kind == "anonymous":
        raise ApiError(401, f"{what} needs the admin key ({ADMIN_FLAG}); send "
                       "Authorization: Bearer <key>", code="invalid_api_key")
    who = "a tenant's key" if caller.kind == "tenant" else "the --api-key key"
    if not caller.admin_key_set:
        raise ApiError(403, f"{what} needs the admin key, and this server was started "
                       f"without {ADMIN_FLAG}: {who} has no admin rights",
                       "permission_error", code="admin_key_required")
    raise ApiError(403, f"{what} needs the admin key ({ADMIN_FLAG}); {who} has no admin "
                   "rights", "permission_error", code="admin_key_required")


def require_server_wide(request: Request, what: str) -> None:
    """403 for a tenant: ``what`` reports every tenant's traffic."""
    if request_caller(request).kind == "tenant":
        raise ApiError(403, f"{what} reports every tenant's traffic: it needs the admin key "
                       f"({ADMIN_FLAG})", "permission_error", code="admin_key_required")
