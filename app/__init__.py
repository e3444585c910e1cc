"""VAE render service: resident VAE decoders behind an HTTP API."""

__version__ = "0.1.0"
