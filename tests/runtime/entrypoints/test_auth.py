"""Who may call what (``auth.py``), tenant-scoped rids (``tenant_rids.py``) and
``--weights-root`` (``weights_root.py``), without a server."""

from __future__ import annotations

import os

import pytest
from starlette.requests import Request

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.auth import (
    ApiKeys,
    Caller,
    require_admin,
    require_server_wide,
)
from radixlm.runtime.entrypoints.weights_root import resolve_under_root
from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.tokenizer_manager.tenant_rids import (
    abort_matches,
    check_client_rid,
    client_rid,
    rid_tenant,
    scoped_rid,
)


def _keys(api_key: str | None, admin: str | None) -> ApiKeys | None:
    return ApiKeys.from_args(ServerArgs(api_key=api_key, admin_api_key=admin))


def _request(caller: Caller | None) -> Request:
    state = {} if caller is None else {"caller": caller, "tenant": caller.tenant}
    return Request({"type": "http", "method": "GET", "path": "/", "headers": [],
                    "state": state})


def _admin_status(caller: Caller | None) -> int:
    try:
        require_admin(_request(caller), "/flush_cache")
    except ApiError as e:
        assert "--admin-api-key" in e.message and "/flush_cache" in e.message, e.message
        return e.status
    return 200


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a alice\nsk-b bob\n")
    return str(path)


def test_no_keys_everyone_is_admin(tmp_path):
    assert _keys(None, None) is None
    assert _admin_status(None) == 200  # no middleware: SGLang's open server


def test_one_key_is_the_admin_unless_an_admin_key_is_set(tmp_path):
    single = _keys("sk-one", None)
    assert single.caller(b"sk-one") == Caller("admin")  # SGLang's ADMIN_OPTIONAL
    assert single.caller(b"") is None and single.caller(b"sk-on") is None
    both = _keys("sk-one", "sk-root")
    user = both.caller(b"sk-one")
    assert user.kind == "user" and _admin_status(user) == 403
    assert _admin_status(both.caller(b"sk-root")) == 200
    assert both.caller(b"sk-wrong") is None


def test_admin_key_alone_leaves_other_routes_open(tmp_path):
    keys = _keys(None, "sk-root")
    anonymous = keys.caller(b"")
    assert anonymous.kind == "anonymous" and anonymous.tenant is None
    assert _admin_status(anonymous) == 401
    assert _admin_status(keys.caller(b"sk-root")) == 200


def test_tenant_keys_are_never_admin(tmp_path, key_file):
    with_admin = _keys(key_file, "sk-root")
    alice = with_admin.caller(b"sk-a")
    assert alice == Caller("tenant", "alice", True)
    assert _admin_status(alice) == 403
    assert _admin_status(with_admin.caller(b"sk-root")) == 200
    without = _keys(key_file, None)
    assert _admin_status(without.caller(b"sk-b")) == 403  # nobody is the admin
    with pytest.raises(ApiError, match="every tenant's traffic") as e:
        require_server_wide(_request(alice), "/get_load")
    assert e.value.status == 403
    require_server_wide(_request(with_admin.caller(b"sk-root")), "/get_load")
    with pytest.raises(ValueError, match="must differ"):
        _keys(key_file, "sk-a")


def test_tenant_rids():
    assert scoped_rid(None, "r1") == "r1"
    inner = scoped_rid("alice", "r1")
    assert inner != "r1" and client_rid(inner) == "r1" and rid_tenant(inner) == "alice"
    assert client_rid(inner + "-0") == "r1-0" and rid_tenant("r1") is None
    bob = scoped_rid("bob", "r1")
    assert abort_matches(inner, "r", "alice") and not abort_matches(bob, "r", "alice")
    assert not abort_matches(inner, "alice", "bob")  # no prefix reaches another tenant
    assert not abort_matches("r1", "r", "alice")  # nor an untenanted request
    assert abort_matches(inner, "r1", None) and abort_matches(bob, "r", None)  # the admin
    with pytest.raises(ValueError, match="U\\+001F"):
        check_client_rid("alice\x1fr1")


def test_weights_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "v2").mkdir(parents=True)
    outside.mkdir()
    (root / "v2" / "config.json").write_text("{}")
    os.symlink(outside, root / "link")
    os.symlink(outside / "w.safetensors", root / "v2" / "w.safetensors")
    (root / "v3").mkdir()
    assert resolve_under_root(str(outside), None) == str(outside)  # no root: as given
    assert resolve_under_root(str(root / "v3"), str(root)) == os.path.realpath(root / "v3")
    for path, status in [(outside, 403), (root / "link", 403), (root / "v3" / ".." / "..", 403),
                         (root / "v2", 403), (root / "missing", 400),
                         (root / "v2" / "config.json", 400)]:
        with pytest.raises(ApiError) as e:
            resolve_under_root(str(path), str(root))
        assert e.value.status == status and "--weights-root" in e.value.message, path
