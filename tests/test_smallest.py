"""The smallest latent each decoder takes and the smallest input each encoder takes, for every
embedded recipe: a part takes ``min_cells`` latent cells along H and W (2 where a conv pads
by reflection: one cell has nothing to reflect), and the protocol refuses fewer with a 422
before the body is read. Before, LTX-2's decoder and MiniMax-H3's encoder raised inside the
decode on one cell, which the service answered 503 "retry later"."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from app.families import family, keys
from app.protocol import Limits, ModelGeometry, ProtocolError
from app.protocol.encode import EncoderGeometry, read_image
from app.protocol.request import Output
from app.protocol.shapes import check_shape


def png_of(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (90, 120, 150)).save(buf, "PNG")
    return buf.getvalue()


RECIPES = [(key, name) for key in keys() for name in family(key).synthetic]


def _cells(cells: int, channels: int, video: bool, frames: int = 1) -> tuple[int, ...]:
    return (1, channels, frames, cells, cells) if video else (1, channels, cells, cells)


@pytest.mark.parametrize(("key", "name"), RECIPES)
def test_the_smallest_latent_decodes_and_one_less_is_a_422(key, name):
    recipe = family(key).synthetic[name]
    decoder = family(key).decoder.module(dict(recipe.config)).eval()
    least = decoder.min_cells
    with torch.inference_mode():
        out = decoder.decode(torch.zeros(_cells(least, decoder.latent_channels, decoder.is_video)))
    assert out.shape[-1] == least * decoder.spatial_scale
    geo, limits = ModelGeometry.of(decoder), Limits()
    if least > 1:
        small = _cells(least - 1, decoder.latent_channels, decoder.is_video)
        with pytest.raises(ProtocolError) as refused:
            check_shape(small, geo, limits, Output.TENSOR, 4)
        assert refused.value.status == 422 and f"{least}x{least}" in refused.value.expected
        check_shape(small, geo, limits, Output.PREVIEW, 4)  # a preview runs no decoder


@pytest.mark.parametrize(
    ("key", "name"), [r for r in RECIPES if family(r[0]).synthetic[r[1]].encoder_config]
)
def test_the_smallest_input_encodes_and_one_cell_less_is_a_422(key, name):
    recipe = family(key).synthetic[name]
    encoder = family(key).encoder.module(dict(recipe.encoder_config)).eval()
    side = encoder.min_cells * encoder.spatial_scale
    frames = 1 + encoder.temporal_scale if encoder.is_video else 1
    with torch.inference_mode():
        encoder.moments(torch.zeros(_cells(side, 3, encoder.is_video, frames)))
    if encoder.min_cells > 1:
        small = png_of(side - encoder.spatial_scale)
        with pytest.raises(ProtocolError) as refused:
            read_image(small, "png", 8, EncoderGeometry.of(encoder), Limits())
        assert refused.value.status == 422 and refused.value.expected == f">= {side} px"
