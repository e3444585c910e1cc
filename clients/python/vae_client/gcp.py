"""Google ID tokens for a private Cloud Run service (``pip install vae-render-client[gcp]``).

    from vae_client import Client
    from vae_client.gcp import id_token_provider

    client = Client(url, token=id_token_provider(url))

Cloud Run IAM wants ``Authorization: Bearer <ID token>`` whose audience is the service URL;
the tokens expire after an hour, so the client asks the provider for a new one before that
(the JWT's ``exp``) and after a 401. google-auth finds the credential: the metadata server on
Cloud Run / GCE / GKE, or a service account key in ``GOOGLE_APPLICATION_CREDENTIALS``. (A
user's ``gcloud auth login`` credential cannot mint ID tokens for an audience: impersonate
a service account instead.) google-auth is imported only when a provider is made.
"""

from __future__ import annotations

from collections.abc import Callable


def id_token_provider(audience: str) -> Callable[[], str]:
    """A token provider: a Google ID token for ``audience`` (the service URL) per call."""
    try:
        import google.auth.transport.requests
        import google.oauth2.id_token
    except ImportError as exc:
        raise ImportError(
            "Google ID tokens need google-auth: pip install 'vae-render-client[gcp]'"
        ) from exc
    request = google.auth.transport.requests.Request()
    audience = audience.rstrip("/")

    def fetch() -> str:
        return google.oauth2.id_token.fetch_id_token(request, audience)

    return fetch
