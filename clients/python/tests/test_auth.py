"""Token providers against a live server with VAE_API_TOKENS: refreshed before expiry, and
once per request after a 401 (a rotated or revoked token); sync and async clients."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest

from vae_client import AsyncClient, Client, DecodeError, Token, TokenSource, jwt_expiry

LATENT = np.random.default_rng(0).standard_normal((1, 16, 4, 4)).astype(np.float32)


class Rotating:
    """A provider handing out the given tokens in turn (the last one forever), counting calls."""

    def __init__(self, *tokens: str | Token) -> None:
        self.tokens, self.calls = list(tokens), 0

    def __call__(self) -> str | Token:
        self.calls += 1
        return self.tokens[min(self.calls, len(self.tokens)) - 1]


@pytest.fixture(scope="module")
def secured(flux_store):
    """The service accepting only the current tokens "new-1" and "new-2"."""
    import tests.live as live

    with live.live_server(flux_store, dtype="float32", default_model="flux-tiny",
                          api_tokens="new-1,new-2") as url:  # fmt: skip
        yield url


def _png(data: bytes) -> bool:
    return data[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_401_calls_the_provider_again_and_succeeds(secured):
    provider = Rotating("rotated-out", "new-1")
    with Client(secured, token=provider, max_retries=0) as client:
        assert _png(client.decode(LATENT))
        assert provider.calls == 2 and client.last_call.attempts == 2
        assert _png(client.decode(LATENT))  # the new token is kept
        assert provider.calls == 2 and client.last_call.attempts == 1


def test_a_second_401_is_raised_not_looped(secured):
    provider = Rotating("bad-1", "bad-2", "bad-3")
    with Client(secured, token=provider, max_retries=3) as client:
        with pytest.raises(DecodeError) as refused:
            client.decode(LATENT)
    assert refused.value.status == 401 and provider.calls == 2


def test_the_provider_is_called_before_the_token_expires(secured):
    margin, lifetime = 30.0, 4.0
    issued: list[Token] = []

    def provider() -> Token:  # each token valid `lifetime` s past the margin from its issue
        issued.append(Token(f"new-{len(issued) % 2 + 1}", time.time() + margin + lifetime))
        return issued[-1]

    with Client(secured, token=provider, token_refresh_margin=margin) as client:
        assert _png(client.decode(LATENT)) and len(issued) == 1
        assert _png(client.decode(LATENT)) and len(issued) == 1  # still fresh
        time.sleep(max(0.0, issued[0].expires_at - margin - time.time()) + 0.1)
        assert _png(client.decode(LATENT))
        # refreshed before sending: no 401 round trip
        assert len(issued) == 2 and client.last_call.attempts == 1
        assert client.models()  # GET routes carry the provider's token too


def test_async_client_refreshes_on_401_and_before_expiry(secured):
    calls: list[str] = []

    def provider() -> str | Token:  # a rotated-out token, then new-1 due soon, then new-2
        calls.append(["rotated-out", "new-1", "new-2"][min(len(calls), 2)])
        return Token(calls[-1], time.time() + 60.5) if calls[-1] == "new-1" else calls[-1]

    async def run() -> list[int]:
        async with AsyncClient(secured, token=provider, max_retries=0) as client:
            assert _png(await client.decode(LATENT))
            seen = [len(calls), client.last_call.attempts]
            await asyncio.sleep(0.6)  # new-1 is now within the 60 s margin of its expiry
            assert _png(await client.decode(LATENT))
            return [*seen, len(calls), client.last_call.attempts]

    assert asyncio.run(run()) == [2, 2, 3, 1]


def test_static_token_is_not_retried_on_401(secured):
    with Client(secured, token="rotated-out") as client:
        with pytest.raises(DecodeError) as refused:
            client.decode(LATENT)
    assert refused.value.status == 401 and client.last_call is None


def _jwt(claims: dict) -> str:
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


def test_jwt_expiry_is_read_from_a_provider_string():
    assert jwt_expiry(_jwt({"exp": 1_900_000_000, "aud": "x"})) == 1_900_000_000
    assert jwt_expiry("opaque-token") is None and jwt_expiry("a.b.c") is None
    exp = time.time() + 3600
    source = TokenSource(Rotating(_jwt({"exp": exp}), "later"), margin=60)
    first = source.get()
    assert source.get() == first  # an hour left: cached
    source = TokenSource(Rotating(_jwt({"exp": time.time() + 30}), "later"), margin=60)
    source.get()
    assert source.get() == "later"  # inside the margin: refreshed


def test_a_provider_returning_nothing_is_an_error():
    with pytest.raises(TypeError, match="token provider"):
        TokenSource(lambda: "").get()
