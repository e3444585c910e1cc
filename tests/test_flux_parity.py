"""The FLUX-family decoder against diffusers' AutoencoderKL / AutoencoderKLFlux2 decode."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLFlux2

from app.families import ops
from app.families.flux import decoder as flux
from app.families.flux.decoder.model import ResnetBlock
from tests.helpers import cosine

SMALL = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8)

CASES = {
    # name: (diffusers class, kwargs, latent shape)
    "flux1": (
        AutoencoderKL,
        dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False),
        (1, 16, 12, 12),
    ),
    "sd-4ch": (AutoencoderKL, dict(latent_channels=4), (2, 4, 8, 8)),
    "non-square": (
        AutoencoderKL,
        dict(latent_channels=16, use_post_quant_conv=False, block_out_channels=(32, 64, 64)),
        (1, 16, 6, 10),
    ),
    "flux2": (AutoencoderKLFlux2, dict(latent_channels=32), (1, 32, 8, 12)),
}


def _pair(cls, kwargs):
    torch.manual_seed(0)
    ref = cls(
        **{**SMALL, **kwargs},
        down_block_types=("DownEncoderBlock2D",)
        * len(kwargs.get("block_out_channels", SMALL["block_out_channels"])),
        up_block_types=("UpDecoderBlock2D",)
        * len(kwargs.get("block_out_channels", SMALL["block_out_channels"])),
    ).eval()
    if isinstance(ref, AutoencoderKLFlux2):
        ref.bn.running_mean.normal_()
        ref.bn.running_var.uniform_(0.5, 2.0)
    return ref


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_diffusers(case, tmp_path):
    cls, kwargs, shape = CASES[case]
    ref = _pair(cls, kwargs)
    ref.save_pretrained(tmp_path)
    config, state = flux.convert(tmp_path)
    ours = flux.Decoder(config).eval()
    ours.load_state_dict(state)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref.decode(z).sample
        got = ours.decode(z)
    cos = cosine(got, expected)
    err = (got - expected).abs().max().item()
    print(f"{case}: cos={cos:.8f} max_abs={err:.2e}")
    assert got.shape == expected.shape
    assert cos >= 0.99999


def test_flux2_denormalize_matches_pipeline():
    """FLUX.2's BatchNorm de-normalization, as its pipeline applies it before decode."""
    ref = _pair(AutoencoderKLFlux2, dict(latent_channels=32))
    config = {
        "latent_channels": 32,
        "block_out_channels": [32, 64],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "use_post_quant_conv": True,
        "latent_bn": True,
    }
    ours = flux.Decoder(config)
    ours.bn.load_state_dict(
        {
            k.removeprefix("bn."): v
            for k, v in ref.state_dict().items()
            if k.startswith("bn.running_m") or k.startswith("bn.running_v")
        }
    )
    patched = torch.randn(1, 128, 4, 6)
    std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps)
    expected = ops.unpatchify2x2(patched * std + ref.bn.running_mean.view(1, -1, 1, 1))
    got = ours.denormalize(ops.unpatchify2x2(patched))
    assert torch.allclose(got, expected, atol=1e-6)


def _small_flux1() -> flux.Decoder:
    """Our decoder holding the weights of a small diffusers FLUX.1-style decoder."""
    ref = _pair(AutoencoderKL, dict(latent_channels=16, use_post_quant_conv=False))
    config = {"latent_channels": 16, "block_out_channels": [32, 64], "layers_per_block": 1}
    ours = flux.Decoder({**config, "norm_num_groups": 8})
    decoder = {k: v for k, v in ref.state_dict().items() if k.startswith("decoder.")}
    ours.load_state_dict({k.removeprefix("decoder."): v for k, v in decoder.items()})
    return ours


def test_optimized_modules_are_exact():
    """``optimize`` swaps in the 4-phase upsample and in-place SiLU; below band_min_pixels."""
    ours = _small_flux1()
    z = torch.randn(1, 16, 7, 9)
    with torch.no_grad():
        plain = ours.decode(z)
        ours.optimize()
        fast = ours.decode(z)
    assert not any(isinstance(m, flux.model.Upsample) for m in ours.modules())
    assert (fast - plain).abs().max().item() < 1e-4
    assert cosine(fast, plain) >= 0.999999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phase_upsample_of_channels_last_weights(dtype):
    """Each phase kernel of a channels-last conv is channels-last itself (else every call
    reorders it), and the phases compute conv3x3(nearest2x(x)) exactly as before."""
    cl = torch.channels_last
    w = torch.randn(24, 16, 3, 3).to(dtype).contiguous(memory_format=cl)
    x = torch.randn(1, 16, 6, 5).to(dtype).contiguous(memory_format=cl)
    phases = ops.upsample_conv_phase_weights(w)
    assert all(phases[a, c].is_contiguous(memory_format=cl) for a in (0, 1) for c in (0, 1))
    got = ops.upsample2x_conv3x3_phases(x, phases, None)
    assert torch.equal(got, ops.upsample2x_conv3x3_phases(x, phases.contiguous(), None))
    up = torch.nn.functional.interpolate(x.double(), scale_factor=2.0, mode="nearest")
    want = torch.nn.functional.conv2d(up, w.double(), padding=1)
    assert cosine(got, want) >= (0.99999 if dtype == torch.float32 else 0.999)


@pytest.mark.parametrize("optimized", [False, True])
def test_banded_path_is_exact(optimized):
    """Row bands with gathered GroupNorm statistics equal the whole-tensor decode."""
    ours = _small_flux1()
    z = torch.randn(2, 16, 13, 11)
    with torch.no_grad():
        plain = ours.decode(z)
        assert torch.equal(ours.decode(z, tiled=True), ours.decode(z, tiled=True))
        if optimized:
            ours.optimize()
        ours.band_bytes = 4096  # a few rows per band: many band edges
        banded = ours.to(memory_format=torch.channels_last).decode(z, tiled=True)
        unbanded = ours.decode(z, tiled=False)
    assert cosine(banded, plain) >= 0.999999
    assert (banded - plain).abs().max().item() < 1e-4
    assert not torch.equal(banded, unbanded)  # a different summation order: really banded


def test_default_policy_bands_large_outputs_of_optimized_copies(monkeypatch):
    """tiled=None: bands only once optimized and only from band_min_pixels on."""
    ours, calls = _small_flux1(), []
    real = flux.fast._resnet
    monkeypatch.setattr(flux.fast, "_resnet", lambda *a: calls.append(1) or real(*a))
    z = torch.randn(1, 16, 4, 4)
    pixels = (4 * ours.spatial_scale) ** 2
    with torch.no_grad():
        ours.band_min_pixels = 0
        ours.decode(z)
        assert not calls  # exact: never banded by default
        ours.optimize()
        ours.band_min_pixels = pixels + 1
        ours.decode(z)
        assert not calls  # below the threshold
        ours.band_min_pixels = pixels
        ours.decode(z)
        assert calls


def test_forward_has_no_fast_path_branches():
    """The exact ResnetBlock is the plain architecture (the fast path lives in fast.py)."""
    block = ResnetBlock(8, 16, 4)
    x = torch.randn(1, 8, 5, 5)
    h = block.conv1(torch.nn.functional.silu(block.norm1(x)))
    h = block.conv2(torch.nn.functional.silu(block.norm2(h)))
    torch.testing.assert_close(block(x), block.conv_shortcut(x) + h, rtol=0, atol=0)
