"""schemas.nats_address: what the router's NATS link and the plugin's transport connect
with (nats_connection), and the refusal of a URL whose user info cannot be read.

nats-py reads a URL's user info as it is written, never percent-decoded: a password with
'/', '#', '?', '@' or '%' could not be used (escaped, it reached NATS escaped; unescaped,
'/', '#' and '?' ended the host part, and nats-py connected to a host made of the user
name). The real server takes the decoded credentials: see
tests/integration/plugin/test_plugin_nats_credentials.py and
tests/integration/service/test_service_nats_link.py.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest

from kvhint.schemas.nats_address import (
    NatsConnection,
    nats_connection,
    nats_url_problem,
    url_secret,
)

PASSWORD = "p/a#s?s@w%rd"


def test_percent_encoded_credentials_are_decoded_and_the_servers_stripped() -> None:
    url = (f"nats://kv%3Ahint:{quote(PASSWORD, safe='')}@nats-a:4222, "
           f"tls://kv%3Ahint:{quote(PASSWORD, safe='')}@[::1]:4223,nats://plain:4222")
    assert nats_url_problem(url) is None
    assert nats_connection(url) == NatsConnection(
        ("nats://nats-a:4222", "tls://[::1]:4223", "nats://plain:4222"),
        user="kv:hint", password=PASSWORD)
    assert url_secret(url.split(",")[0]) == PASSWORD


def test_a_user_name_alone_is_a_token_as_nats_py_reads_it() -> None:
    assert nats_connection("nats://t%2Fok@h:4222") == NatsConnection(
        ("nats://h:4222",), token="t/ok")
    assert nats_connection("nats://h:4222") == NatsConnection(("nats://h:4222",))
    # An unencoded '@' or '%' that is no escape reads as nats-py read it before.
    assert nats_connection("nats://u:p@ss%@h:4222").password == "p@ss%"


def test_the_secrets_are_out_of_the_repr() -> None:
    shown = repr(nats_connection(f"nats://u:{quote(PASSWORD, safe='')}@h:4222"))
    assert "w%rd" not in shown and "p/a" not in shown and "tok" not in repr(
        nats_connection("nats://tok@h:4222"))


@pytest.mark.parametrize(("url", "says"), [
    # Unencoded '/', '#' or '?': before, each of these passed (or was refused naming the
    # password) and nats-py would have connected to the host "u" or "p".
    (f"nats://u:{PASSWORD}@h:4222", "server 1 of 1 ('nats://***@h:4222') has a '/', '#' or '?'"),
    ("nats://h0:4222,nats://tok/en@h:4222", "server 2 of 2 ('nats://***@h:4222') has a '/'"),
    ("nats://u:p,w@h:4222", "server 2 of 2 ('***@h:4222') has no nats://"),
    ("nats://u:p w@h:4222", "is written %20"),
    ("nats://u:%ff@h:4222", "does not decode as UTF-8"),
    ("nats://u:pw@h:4222,nats://u:s3cond@h2:4222", "server 2 of 2 ('nats://***@h2:4222') has "
                                                 "other credentials than server 1"),
    ("nats://u:pw@h:99999", "server 1 of 1 ('nats://***@h:99999') has no valid port"),
])
def test_a_url_whose_user_info_cannot_be_read_is_refused_naming_the_server(
        url: str, says: str) -> None:
    problem = nats_url_problem(url)
    assert problem is not None and says in problem
    for secret in ("p/a", "w%rd", "tok/en", "p,w", "p w", "%ff", "s3cond", ":pw@"):
        assert secret not in problem
    with pytest.raises(ValueError, match="server"):
        nats_connection(url)
