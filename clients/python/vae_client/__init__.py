"""Client for the VAE render service: latents in, encoded images and video out (and back:
``encode``, pixels in, latents out). No torch.

Latents go in as numpy arrays (float32/float16), raw little-endian bytes with
``shape``/``dtype``, a ``.npy``/``.safetensors`` path, or a torch tensor when the caller
already has torch loaded (bfloat16 included). Images come back as encoded bytes (or PIL),
tensors as numpy, MP4 as bytes or streamed to a file. A video's answer streams while it
decodes: ``progress=`` (a callable ``(frames_in, frames_total)``, or True for a bar on a
terminal's stderr) follows it::

    from vae_client import Client

    client = Client("http://127.0.0.1:8080")
    png = client.decode(latent, model="flux1-synthetic", do_scaling=True)
    z = client.encode(Image.open("photo.png"), model="flux1-synthetic", do_scaling=True)  # numpy latent
    video = client.decode("z.npy", model="ltx-tiny", output="tensor", progress=True)

429/503 are retried after ``Retry-After`` (jittered, at most ``max_retries`` times, never
past ``deadline``); a refused request raises ``DecodeError`` with the server's ``error`` and
``expected``.
"""

from vae_client.aio import AsyncClient
from vae_client.auth import Token, TokenProvider, TokenSource, jwt_expiry
from vae_client.base import DEFAULT_URL
from vae_client.errors import DeadlineExceeded, DecodeError
from vae_client.progress import ProgressBar
from vae_client.retry import RetryPolicy, parse_retry_after
from vae_client.sync import Client, decode, encode
from vae_client.timing import CallInfo, parse_server_timing
from vae_client.wire import LATENT_FILE_TYPES, OUTPUTS, SUFFIX_OUTPUT, output_for_path

__all__ = [
    "DEFAULT_URL",
    "LATENT_FILE_TYPES",
    "OUTPUTS",
    "SUFFIX_OUTPUT",
    "AsyncClient",
    "CallInfo",
    "Client",
    "DeadlineExceeded",
    "DecodeError",
    "ProgressBar",
    "RetryPolicy",
    "Token",
    "TokenProvider",
    "TokenSource",
    "decode",
    "encode",
    "jwt_expiry",
    "output_for_path",
    "parse_retry_after",
    "parse_server_timing",
]
