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

from app.families import FAMILIES, family_module, winograd
from app.families.flux.decoder.model import FLUX1_CONFIG
from app.families.ltx.decoder import streaming


def on_meta(family: str, config: dict[str, Any]) -> Any:
    with torch.device("meta"):
        return family_module(family).Decoder(dict(config)).eval()


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


def tiles_decoded(monkeypatch, family: str, decoder: Any, z: torch.Tensor) -> int:
    """Tiles (bands) of the last spatial stage one ``decode(z, tiled=True)`` runs, per
    frame chunk."""
    if family == "flux":  # row bands of conv_out
        calls = counting(
            monkeypatch, winograd, "conv_rows", lambda conv, x: conv is decoder.conv_out
        )
        decoder.decode(z, tiled=True)
        return len(calls)
    if family == "ltx":
        calls = counting(monkeypatch, streaming, "_decode_tile", lambda *a, **k: True)
        decoder.decode(z, tiled=True, chunk_frames=0)
        return len(calls)
    calls = counting(monkeypatch, decoder, "forward", lambda *a, **k: True)  # wan, hunyuan
    decoder.decode(z, tiled=True, chunk_frames=0, windowed=False)
    return len(calls)


TILING = {
    "flux": FLUX1_CONFIG,
    "ltx": family_module("ltx").SYNTHETIC["ltx-tiny"],
    "wan": family_module("wan").SYNTHETIC["wan2.1-tiny"],
    "hunyuan-video": family_module("hunyuan-video").SYNTHETIC["hunyuan-video-tiny"],
}


def test_every_tiling_family_is_covered() -> None:
    tiling = {f for f in FAMILIES if family_module(f).Decoder.supports_tiling}
    assert tiling == set(TILING)


@pytest.mark.parametrize("family", sorted(TILING))
def test_tiled_probe_decodes_in_several_tiles(monkeypatch, family) -> None:
    decoder = on_meta(family, TILING[family])
    gen = torch.Generator().manual_seed(0)
    tiled = decoder.probe_latent(gen, tiled=True).to("meta")
    plain = decoder.probe_latent(gen).to("meta")
    with torch.inference_mode():
        assert tiles_decoded(monkeypatch, family, decoder, tiled) > 1
        monkeypatch.undo()
        if family != "flux":  # FLUX's plain probe may span bands too: nothing to compare
            assert tiles_decoded(monkeypatch, family, decoder, plain) <= 1
