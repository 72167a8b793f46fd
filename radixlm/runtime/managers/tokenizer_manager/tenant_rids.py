"""Request ids scoped per tenant.

A tenant's rid reaches the scheduler as ``<tenant>\\x1f<rid>``: two tenants may use the
same rid at once, "rid is already in use" speaks only of the tenant's own requests, and an
abort by rid prefix matches only the tenant's own. Clients never see the scoped form:
responses, streams and the request log show ``client_rid``. Tenant names cannot hold the
separator (``auth.TENANT_NAME``) and client rids are refused with it (``check_client_rid``),
so the scoped form is unambiguous. Untenanted requests (no keys, one ``--api-key``, the
admin) keep their rid as it is.
"""

from __future__ import annotations

RID_SEP = "\x1f"  # U+001F, the unit separator (cache namespaces use it too)


def check_client_rid(rid: str) -> None:
    """ValueError if a client's rid holds the separator of the scoped form."""
    if RID_SEP in rid:
        raise ValueError("rid must not contain the control character U+001F (it separates "
                         "a tenant from its rids)")


def scoped_rid(tenant: str | None, rid: str) -> str:
    """The rid the scheduler sees for ``tenant``'s ``rid``."""
    return rid if tenant is None else f"{tenant}{RID_SEP}{rid}"


def client_rid(rid: str) -> str:
    """The rid its client sent (or was given): the scoped form without its tenant."""
    return rid.split(RID_SEP, 1)[-1]


def rid_tenant(rid: str) -> str | None:
    """The tenant of a scoped rid (None: an untenanted request)."""
    tenant, sep, _ = rid.partition(RID_SEP)
    return tenant if sep else None


def abort_matches(rid: str, prefix: str, tenant: str | None) -> bool:
    """Whether an abort by ``prefix`` from ``tenant`` reaches the request ``rid``: a tenant
    reaches only its own rids; an untenanted caller (the admin, or anyone on a server
    without tenants) reaches every request whose client rid starts with ``prefix``."""
    if tenant is None:
        return client_rid(rid).startswith(prefix)
    return rid.startswith(scoped_rid(tenant, prefix))
