"""Winograd F(4x4, 3x3) convolution against PyTorch's conv, alone and inside the FLUX fast path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from torch import nn

from app.families import ops, winograd
from app.families.flux import decoder as flux
from app.families.hunyuan_video import decoder as hunyuan_video
from app.families.wan import decoder as wan
from app.runtime import modes
from tests import helpers, test_hunyuan_video, test_ltx, test_ltx2, test_wan
from tests.helpers import cosine


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize(
    "batch, cin, cout, h, w, pad_rows, channels_last",
    [
        (1, 128, 128, 16, 16, 1, True),  # whole tiles
        (2, 128, 256, 9, 11, 1, True),  # batch, crop in both dims
        (1, 256, 128, 10, 12, 0, True),  # rows that carry their halo (a band)
        (1, 96, 64, 7, 5, 1, False),  # NCHW input, narrow
        (1, 64, 64, 1, 1, 1, True),  # one pixel
        (1, 64, 64, 4, 40, 1, True),  # wider than one band at a tiny band budget
    ],
)
def test_conv3x3_matches_conv2d(batch, cin, cout, h, w, pad_rows, channels_last, monkeypatch):
    monkeypatch.setattr(winograd, "TRANSFORMED_BLOCK_BYTES", 1 << 16)  # several bands even here
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cin, h, w, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(cout, cin, 3, 3, generator=gen) / (9 * cin) ** 0.5
    bias = torch.randn(cout, generator=gen)
    want = F.conv2d(x.double(), weight.double(), bias.double(), padding=(pad_rows, 1))
    got = winograd.conv3x3(x, winograd.transform_weight(weight), bias, pad_rows=pad_rows)
    assert got.shape == want.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    # float32 direct convs are ~2e-6 off here; the transforms cost a few times that
    assert _relative_error(got, want) < 5e-5
    assert cosine(got, want) >= 0.9999999
    unbiased = winograd.conv3x3(x, winograd.transform_weight(weight), None, pad_rows=pad_rows)
    assert _relative_error(unbiased + bias[:, None, None], want) < 5e-5


def test_module_keeps_parameters_and_falls_back_for_gradients():
    conv = nn.Conv2d(128, 128, 3, padding=1)
    names = [name for name, _ in conv.named_parameters()]
    keys = set(conv.state_dict())
    winograd.prepare(conv)
    assert isinstance(conv, winograd.WinogradConv2d)
    assert [name for name, _ in conv.named_parameters()] == names
    assert set(conv.state_dict()) == keys  # the transformed weight is not saved or loaded
    x = torch.randn(1, 128, 8, 8).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = F.conv2d(x, conv.weight, conv.bias, padding=1)
        assert _relative_error(conv(x), want.double()) < 5e-5
    y = conv(x)  # parameters want gradients: PyTorch's conv, which records them
    y.sum().backward()
    assert conv.weight.grad is not None


@pytest.mark.parametrize(
    "conv, suits",
    [
        (nn.Conv2d(128, 128, 3, padding=1), True),
        (nn.Conv2d(64, 128, 3, padding=1), False),  # too narrow to gain
        (nn.Conv2d(128, 128, 3, padding=1, stride=2), False),
        (nn.Conv2d(128, 128, 1), False),
        (nn.Conv2d(128, 128, 3, padding=1, groups=2), False),
        (nn.Conv2d(128, 128, 3, padding=1, padding_mode="reflect"), False),
    ],
)
def test_suits(conv, suits):
    assert winograd.suits(conv) is suits


def _flux_pair() -> tuple[flux.Decoder, AutoencoderKL]:
    """A FLUX.1-shaped decoder wide enough (128 channels) for the Winograd convs."""
    config = dict(block_out_channels=[128, 128], layers_per_block=1, norm_num_groups=32)
    ref = helpers.seeded(
        AutoencoderKL,
        latent_channels=16,
        use_quant_conv=False,
        use_post_quant_conv=False,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        **config,
    )
    ours = flux.Decoder({"latent_channels": 16, **config})
    ours.load_state_dict(helpers.decoder_state(ref))
    return ours.eval().requires_grad_(False), ref


@pytest.mark.parametrize("tiled", [False, True])
def test_flux_served_copy_uses_winograd_and_matches_diffusers(tiled):
    ours, ref = _flux_pair()
    served = modes.build(ours, torch.device("cpu"), modes.Mode(torch.float32))
    swapped = [m for m in served.modules() if isinstance(m, winograd.WinogradConv2d)]
    assert len(swapped) == 2 * (2 + 2 * 2)  # conv1, conv2 of mid (2 resnets), up blocks (2 x 2)
    assert not any(isinstance(m, winograd.WinogradConv2d) for m in ours.modules())
    served.band_bytes = 1 << 16  # bands of a few rows when tiled
    z = torch.randn(1, 16, 6, 10, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref.decode(z).sample
        got = served.decode(z, tiled=tiled)
    assert cosine(got, want) >= 0.99999
    assert (got - want).abs().max().item() < 1e-3
    assert not torch.equal(got, ours.decode(z))  # really another computation


@pytest.mark.parametrize(
    "batch, cin, cout, frames, h, w, kt, padding, channels_last",
    [
        (1, 128, 128, 5, 8, 8, 3, 1, False),  # LTX / Wan: NCDHW, causal taps, zero padding
        (2, 96, 64, 4, 9, 7, 3, 1, True),  # batch, crop, channels_last_3d
        (1, 64, 96, 3, 6, 10, 3, 0, False),  # HunyuanVideo / LTX-2: padded by the caller
        (1, 64, 64, 2, 5, 5, 1, 1, False),  # a 1x3x3 kernel
    ],
)
@pytest.mark.parametrize("band_bytes", [1 << 24, 1 << 12])  # whole clips; one tile row of frames
def test_conv3d_matches_conv3d(
    batch, cin, cout, frames, h, w, kt, padding, channels_last, band_bytes, monkeypatch
):
    monkeypatch.setattr(winograd, "TRANSFORMED_BLOCK_BYTES", band_bytes)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cin, frames, h, w, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    weight = torch.randn(cout, cin, kt, 3, 3, generator=gen) / (9 * kt * cin) ** 0.5
    bias = torch.randn(cout, generator=gen)
    want = F.conv3d(x.double(), weight.double(), bias.double(), padding=(0, padding, padding))
    got = winograd.conv3d(x, winograd.transform_weight(weight), bias, padding)
    assert got.shape == want.shape
    fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
    assert got.is_contiguous(memory_format=fmt)
    assert _relative_error(got, want) < 5e-5
    assert cosine(got, want) >= 0.9999999


def test_prepare_respects_widths_and_ops_conv3d_runs_it():
    model = nn.Sequential(
        nn.Conv3d(128, 128, 3, padding=(0, 1, 1)),
        nn.Conv3d(128, 512, 3, padding=(0, 1, 1)),  # wider than max_channels
        nn.Conv3d(128, 128, 3, padding=1),  # pads in time itself: not a caller-padded conv
        nn.Conv3d(128, 128, (3, 1, 1)),  # no 3x3 spatial kernel
    ).requires_grad_(False)
    winograd.prepare(model, max_channels=256)
    assert [hasattr(conv, "winograd") for conv in model] == [True, False, False, False]
    x = torch.randn(1, 128, 4, 6, 6)
    got = ops.conv3d(x, model[0])
    direct = F.conv3d(x, model[0].weight, model[0].bias, padding=(0, 1, 1))
    assert not torch.equal(got, direct)  # really the Winograd path
    assert _relative_error(got, direct.double()) < 5e-5


def _ltx(module, variant: str):
    ref, ours = module.make_pair(variant)
    z = module.clip(3)
    opts = dict(timestep=module.TIMESTEP, seed=module.SEED, chunk_frames=1)
    return ours, lambda served: served.decode(z, **opts), module.reference_decode(ref, z)


def _imported(module, family, name: str, z: torch.Tensor, folder):
    ref, ours, _ = helpers.import_pair(module.reference(name), family, folder)
    with torch.no_grad():
        expected = ref.decode(z).sample
    return ours, lambda served: served.decode(z, chunk_frames=1), expected


CASES = {
    "ltx": lambda tmp: _ltx(test_ltx, "v091"),
    "ltx2": lambda tmp: _ltx(test_ltx2, "released"),
    "wan": lambda tmp: _imported(test_wan, wan, "wan2.1", helpers.latent(1, 16, 3, 4, 3), tmp),
    "hunyuan-video": lambda tmp: _imported(
        test_hunyuan_video, hunyuan_video, "base", helpers.latent(1, 4, 3, 3, 4), tmp
    ),
}


@pytest.mark.parametrize("family", CASES)
def test_video_families_decode_with_winograd_as_diffusers(family, tmp_path):
    """Every 3x3 conv by Winograd (``min_channels=1``: the tests' models are narrow), inside
    each family's own padding and temporal streaming, against diffusers."""
    ours, decode, expected = CASES[family](tmp_path)
    served = modes.build(ours, torch.device("cpu"), modes.Mode(torch.float32))
    winograd.prepare(served, min_channels=1)
    assert sum(hasattr(m, "winograd") for m in served.modules()) >= 4
    with torch.no_grad():
        got = decode(served)
    helpers.check(f"{family} winograd", got, expected)
