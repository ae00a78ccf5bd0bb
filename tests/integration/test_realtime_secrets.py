"""Client secrets for the Realtime WebSocket, against a real head with --api-key.

Minted with the openai SDK and plain HTTP, used over real WebSocket handshakes (the
``websockets`` client, as a browser would: the secret in the subprotocol list).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from openai import OpenAI
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from omnistage.realtime.secrets import MAX_SESSION_BYTES, ClientSecrets
from tests.integration.harness import HeadProc, wait_for
from tests.integration.test_api_servers import _api_servers

KEY = "K3y"
SECRETS = "/v1/realtime/client_secrets"


@pytest.fixture(scope="module")
def keyed(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(module_tmp, "echo", "--api-key", KEY, name="keyed-head")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


def _ws_url(head: HeadProc) -> str:
    return head.url.replace("http://", "ws://") + "/v1/realtime"


def _handshake(
    url: str, *, bearer: str | None = None, secret: str | None = None
) -> tuple[int, dict | None, str | None]:
    """(HTTP status of the handshake, first event if it opened, chosen subprotocol)."""
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    protocols = ["realtime", f"openai-insecure-api-key.{secret}"] if secret else None
    try:
        with connect(
            url, additional_headers=headers, subprotocols=protocols, open_timeout=10
        ) as ws:
            first = msgspec.json.decode(ws.recv(timeout=10))
            return 101, first, ws.subprotocol
    except InvalidStatus as exc:
        return exc.response.status_code, None, None


def _assert_let_in(url: str, **credentials: str) -> dict:
    """The handshake passed the key check and the session opened; its session.created."""
    status, first, subprotocol = _handshake(url, **credentials)
    assert status == 101, status
    assert first is not None and first["type"] == "session.created", first
    if "secret" in credentials:
        assert subprotocol == "realtime"  # a browser drops a socket that picks none
    return first


def _mint(head: HeadProc, body: dict, key: str = KEY) -> httpx.Response:
    return head.client.post(SECRETS, json=body, headers={"Authorization": f"Bearer {key}"})


def test_the_sdk_mints_a_secret_in_openais_shape(keyed: HeadProc) -> None:
    client = OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY)
    before = time.time()
    created = client.realtime.client_secrets.create(
        session={"type": "realtime", "instructions": "Speak like a pirate."}
    )
    assert created.value.startswith("ek_")
    assert before + 599 <= created.expires_at <= time.time() + 601  # 600 s by default
    assert created.session.type == "realtime"
    assert created.session.object == "realtime.session" and created.session.id
    assert created.session.instructions == "Speak like a pirate."
    shorter = client.realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 10}
    )
    assert shorter.expires_at <= time.time() + 11
    assert shorter.session.type == "realtime"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"expires_after": {"seconds": 9}}, "expires_after.seconds"),
        ({"expires_after": {"seconds": 7201}}, "expires_after.seconds"),
        ({"expires_after": {"seconds": "60"}}, "expires_after.seconds"),
        ({"expires_after": {"anchor": "now"}}, "expires_after.anchor"),
        ({"expires_after": 60}, "expires_after"),
        ({"session": "realtime"}, "session"),
        ({"session": {"type": "translation"}}, "session.type"),
        ({"session": {"instructions": 7}}, "session.instructions"),
        ({"session": {"no_such_field": 1}}, "session.no_such_field"),
        ({"session": {"instructions": "x" * MAX_SESSION_BYTES}}, "session"),
    ],
)
def test_bad_fields_are_a_400_naming_them(keyed: HeadProc, body: dict, param: str) -> None:
    r = _mint(keyed, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_minting_takes_the_api_key_and_a_secret_opens_nothing_over_http(
    keyed: HeadProc,
) -> None:
    assert _mint(keyed, {}, key="wrong").status_code == 401
    secret = _mint(keyed, {}).json()["value"]
    assert _mint(keyed, {}, key=secret).status_code == 401  # no secret mints another
    models = keyed.client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert models.status_code == 401
    assert models.json()["error"]["code"] == "invalid_api_key"


def test_the_realtime_socket_takes_a_secret_or_the_key(keyed: HeadProc) -> None:
    url = _ws_url(keyed)
    secret = _mint(keyed, {"session": {"instructions": "Be brief."}}).json()["value"]
    # As a browser would: in the subprotocol list. The session starts with the config.
    created = _assert_let_in(url, secret=secret)
    assert created["session"]["instructions"] == "Be brief."
    assert _assert_let_in(url, bearer=secret)["session"]["instructions"] == "Be brief."
    assert _assert_let_in(url, bearer=KEY)["session"]["instructions"] != "Be brief."
    _assert_let_in(url, secret=KEY)
    # The largest session config a secret may carry still fits a handshake header.
    big = {"instructions": "x" * (MAX_SESSION_BYTES - len('{"type":"realtime","instructions":""}'))}
    large = _mint(keyed, {"session": big})
    assert large.status_code == 200, large.text
    created = _assert_let_in(url, secret=large.json()["value"])
    assert created["session"]["instructions"] == big["instructions"]


def test_the_realtime_socket_refuses_wrong_expired_and_missing_credentials(
    keyed: HeadProc,
) -> None:
    url = _ws_url(keyed)
    # Signed with the right key, but expired a minute ago.
    expired, _ = ClientSecrets(KEY, clock=lambda: time.time() - 660).mint(None, 600)
    other, _ = ClientSecrets("another key").mint(None, 600)
    for credentials in (
        {"bearer": "wrong"},
        {"secret": "wrong"},
        {"secret": expired},
        {"bearer": expired},
        {"secret": other},
        {},
    ):
        status, _, _ = _handshake(url, **credentials)
        assert status == 401, credentials
    # A refusal is an answer with OpenAI's error body, which a client can show.
    with pytest.raises(InvalidStatus) as refused:
        connect(url, open_timeout=10)
    assert b"invalid_api_key" in refused.value.response.body
    assert keyed.client.get("/health").status_code == 200


def test_a_secret_minted_by_one_api_server_opens_the_socket_on_another(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--api-server-count", "2", "--api-key", KEY)
    try:
        head.wait_healthy()
        wait_for(lambda: len(_api_servers(head)) == 2, 20, what="two API servers")
        # Each mint and each handshake is a new connection, which the kernel hands to
        # either server: the odds that no secret of eight is used on the other server
        # than the one that minted it are about 2**-8.
        for _ in range(8):
            with httpx.Client(base_url=head.url) as fresh:
                r = fresh.post(SECRETS, json={}, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
            _assert_let_in(_ws_url(head), secret=r.json()["value"])
    finally:
        head.stop()


def test_without_an_api_key_the_route_still_answers_and_the_socket_is_open(
    echo_head: HeadProc,
) -> None:
    r = httpx.post(f"{echo_head.url}{SECRETS}", json={"session": {"instructions": "hi"}})
    assert r.status_code == 200, r.text
    assert r.json()["value"].startswith("ek_")
    created = _assert_let_in(_ws_url(echo_head), secret=r.json()["value"])
    assert created["session"]["instructions"] == "hi"
    _assert_let_in(_ws_url(echo_head))
