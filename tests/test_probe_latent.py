"""``probe_latent(tiled=True)``: the latent the gate checks a tiled decode with is larger than
one tile at the geometry ``decode(tiled=True)`` really uses, for every family that tiles.

Decoded on the meta device (shapes only): the tiles / bands are counted where the decode
runs them, by wrapping the function each tile (band) goes through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from app.families import PACKAGES, family, key_of, winograd
from app.families.flux.decoder.model import FLUX1_CONFIG
from app.families.ltx.decoder import streaming


def on_meta(key: str, config: dict[str, Any]) -> Any:
    with torch.device("meta"):
        return family(key).decoder.module(dict(config)).eval()


def counting(monkeypatch, owner: Any, name: str, keep: Callable[..., bool]) -> list[int]:
    """Wrap ``owner.name``; the returned list grows by one for each call ``keep`` accepts."""
    calls: list[int] = []
    real = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if keep(*args, **kwargs):
            calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def tiles_decoded(monkeypatch, key: str, decoder: Any, z: torch.Tensor) -> int:
    """Tiles (bands) of the last spatial stage one ``decode(z, tiled=True)`` runs, per
    frame chunk."""
    if key == "flux":  # row bands of conv_out
        calls = counting(
            monkeypatch, winograd, "conv_rows", lambda conv, x: conv is decoder.conv_out
        )
        decoder.decode(z, tiled=True)
        return len(calls)
    if key == "ltx":
        calls = counting(monkeypatch, streaming, "_decode_tile", lambda *a, **k: True)
        decoder.decode(z, tiled=True, chunk_frames=0)
        return len(calls)
    calls = counting(monkeypatch, decoder, "forward", lambda *a, **k: True)  # wan, hunyuan
    decoder.decode(z, tiled=True, chunk_frames=0, windowed=False)
    return len(calls)


TILING = {
    "flux": FLUX1_CONFIG,
    "ltx": family("ltx").synthetic["ltx-tiny"].config,
    "wan": family("wan").synthetic["wan2.1-tiny"].config,
    "hunyuan-video": family("hunyuan-video").synthetic["hunyuan-video-tiny"].config,
}


def test_every_tiling_family_is_covered() -> None:
    keys = [key_of(package) for package in PACKAGES]  # every family of the service
    tiling = {key for key in keys if family(key).decoder.module.supports_tiling}
    assert tiling == set(TILING)


@pytest.mark.parametrize("key", sorted(TILING))
def test_tiled_probe_decodes_in_several_tiles(monkeypatch, key) -> None:
    decoder = on_meta(key, TILING[key])
    gen = torch.Generator().manual_seed(0)
    tiled = decoder.probe_latent(gen, tiled=True).to("meta")
    plain = decoder.probe_latent(gen).to("meta")
    with torch.inference_mode():
        assert tiles_decoded(monkeypatch, key, decoder, tiled) > 1
        monkeypatch.undo()
        if key != "flux":  # FLUX's plain probe may span bands too: nothing to compare
            assert tiles_decoded(monkeypatch, key, decoder, plain) <= 1


def test_an_entrys_own_band_sizes_the_served_bands_and_the_probe(monkeypatch) -> None:
    """FLUX's ``band_mb`` (an entry's config): the served copy's bands and the tiled probe are
    both of that size, so the gate still checks the geometry served."""
    from app.families.flux.decoder import decode
    from tests.live import TINY_FLUX

    config = TINY_FLUX["flux-tiny"]
    decoder = on_meta("flux", config)
    assert decoder.band_bytes == config["band_mb"] << 20
    default = on_meta("flux", {k: v for k, v in config.items() if k != "band_mb"})
    for device in ("cpu", "cuda"):
        assert decode.band_bytes_for(torch.device(device), config) == config["band_mb"] << 20
        served = decode.band_bytes_for(torch.device(device), default.config)
        assert served == decode.BAND_BYTES[device]
    tiled = decoder.probe_latent(torch.Generator().manual_seed(0), tiled=True)
    assert tiled.numel() < default.probe_latent(torch.Generator(), tiled=True).numel()
    with torch.inference_mode():
        assert tiles_decoded(monkeypatch, "flux", decoder, tiled.to("meta")) > 1
