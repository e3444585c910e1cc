"""The FLUX-family encoder against diffusers' AutoencoderKL / AutoencoderKLFlux2 encode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLFlux2, Flux2Pipeline
from safetensors.torch import save_file

from app.families import family
from app.families.flux import decoder as flux_decoders
from app.families.flux import encoder as flux
from tests.helpers import cosine

SMALL = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8)

CASES = {
    # name: (diffusers class, kwargs); widths shrunk, layouts as the real configs
    "flux1": (AutoencoderKL, dict(latent_channels=16, use_quant_conv=False)),
    "sd3": (
        AutoencoderKL,
        dict(latent_channels=16, use_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609),
    ),
    "sdxl-sd15": (AutoencoderKL, dict(latent_channels=4, layers_per_block=2)),
    "three-down-no-attention": (
        AutoencoderKL,
        dict(latent_channels=16, block_out_channels=(32, 64, 64), mid_block_add_attention=False),
    ),
    "flux2": (AutoencoderKLFlux2, dict(latent_channels=32)),
}
SHAPES = [(1, 3, 64, 64), (2, 3, 48, 80), (1, 3, 57, 83)]  # the last odd: diffusers accepts it


def _reference(cls, **kwargs):
    """A diffusers VAE with seeded non-trivial weights (biases and norm affines too)."""
    torch.manual_seed(0)
    kwargs = {**SMALL, **kwargs}
    n = len(kwargs["block_out_channels"])
    ref = cls(
        **kwargs,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
    ).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        if isinstance(ref, AutoencoderKLFlux2):
            ref.bn.running_mean.copy_(0.5 * torch.randn(ref.bn.running_mean.shape, generator=gen))
            ref.bn.running_var.uniform_(0.5, 2.0, generator=gen)
    return ref


def _imported(ref, folder: Path) -> flux.Encoder:
    ref.save_pretrained(folder)
    config, state = flux.convert(folder)
    ours = flux.Encoder(config).eval()
    ours.load_state_dict(state, strict=True)
    return ours


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    cls, kwargs = CASES[request.param]
    ref = _reference(cls, **kwargs)
    return ref, _imported(ref, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@torch.no_grad()
def test_moments_and_mean_match_diffusers(pair, shape) -> None:
    ref, ours = pair
    x = torch.rand(shape, generator=torch.Generator().manual_seed(2)) * 2 - 1
    dist = ref.encode(x).latent_dist
    got = ours.moments(x)
    assert got.shape == dist.parameters.shape
    assert (ours.latent_channels * 2, *ours.latent_hw(*shape[-2:])) == got.shape[1:]
    assert cosine(got, dist.parameters) >= 0.99999
    assert cosine(ours.encode(x), dist.mode()) >= 0.99999
    # A sample is mean + std * noise: same noise, same sample.
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(3))
    expected = dist.mean + dist.std * noise
    assert cosine(ours.encode(x, sample=True, generator=gen), expected) >= 0.99999


@pytest.mark.parametrize("cls", [AutoencoderKL, AutoencoderKLFlux2], ids=lambda c: c.__name__)
@torch.no_grad()
def test_tiled_encode_matches_enable_tiling(cls, tmp_path) -> None:
    """64 px tiles on a 150x200 input (uneven last tiles): diffusers' blended tiles, which
    differ from the untiled encode (so the check can fail)."""
    ref = _reference(cls, latent_channels=32 if cls is AutoencoderKLFlux2 else 4, sample_size=64)
    ours = _imported(ref, tmp_path)
    x = torch.rand((1, 3, 150, 200), generator=torch.Generator().manual_seed(4)) * 2 - 1
    untiled = ref.encode(x).latent_dist.parameters
    ref.enable_tiling()
    expected = ref.encode(x).latent_dist.parameters
    got = ours.moments(x, tiled=True)
    assert got.shape == expected.shape
    assert cosine(got, expected) >= 0.99999
    assert cosine(untiled, expected) < 0.9999  # the tiles are a different result
    small = x[..., :64, :64]  # fits one tile: tiled=True encodes it whole, as diffusers does
    assert (
        cosine(ours.moments(small, tiled=True), ref.encode(small).latent_dist.parameters) > 0.99999
    )


@torch.no_grad()
def test_normalize_is_the_pipelines_and_inverts_denormalize(tmp_path) -> None:
    ref = _reference(AutoencoderKLFlux2, latent_channels=32)
    ours = _imported(ref, tmp_path)
    z = torch.randn(2, 32, 6, 10, generator=torch.Generator().manual_seed(5))
    # The FLUX.2 pipeline's image-latent normalisation, on the 2x2-patchified latent.
    patched = Flux2Pipeline._patchify_latents(z)
    std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps)
    expected = (patched - ref.bn.running_mean.view(1, -1, 1, 1)) / std
    got = ours.normalize(z)
    assert got.shape == z.shape
    assert cosine(Flux2Pipeline._patchify_latents(got), expected) >= 0.99999
    dconfig, dstate = flux_decoders.convert(tmp_path)
    decoder = flux_decoders.Decoder(dconfig)
    decoder.load_state_dict(dstate)
    assert torch.allclose(decoder.denormalize(got), z, atol=1e-5)


def test_normalize_scale_shift(tmp_path) -> None:
    ref = _reference(
        AutoencoderKL,
        latent_channels=16,
        use_quant_conv=False,
        scaling_factor=1.5305,
        shift_factor=0.0609,
    )
    ours = _imported(ref, tmp_path)
    z = torch.randn(1, 16, 4, 4)
    assert torch.allclose(ours.normalize(z), (z - 0.0609) * 1.5305)
    sd = _reference(AutoencoderKL, latent_channels=4)
    assert torch.allclose(_imported(sd, tmp_path / "sd").normalize(z[:, :4]), z[:, :4] * 0.18215)


# BFL / LDM single-file names, from ours (the inverse of convert's map, written out here).
def _to_ldm(name: str) -> str:
    fixed = {
        "mid_block.resnets.0": "mid.block_1",
        "mid_block.resnets.1": "mid.block_2",
        "mid_block.attentions.0.group_norm": "mid.attn_1.norm",
        "mid_block.attentions.0.to_q": "mid.attn_1.q",
        "mid_block.attentions.0.to_k": "mid.attn_1.k",
        "mid_block.attentions.0.to_v": "mid.attn_1.v",
        "mid_block.attentions.0.to_out.0": "mid.attn_1.proj_out",
        "conv_norm_out": "norm_out",
    }
    for ours, ldm in fixed.items():
        if name.startswith(ours + "."):
            return ldm + name[len(ours) :]
    parts = name.split(".")
    if parts[0] == "down_blocks" and parts[2] == "resnets":
        rest = ".".join(parts[4:]).replace("conv_shortcut", "nin_shortcut")
        return f"down.{parts[1]}.block.{parts[3]}.{rest}"
    if parts[0] == "down_blocks":
        return f"down.{parts[1]}.downsample.{'.'.join(parts[4:])}"
    return name


@pytest.mark.parametrize("case", ["flux1", "sdxl-sd15", "flux2"])
@torch.no_grad()
def test_single_file_layout(case, tmp_path) -> None:
    """A BFL ae.safetensors (1x1-conv attention, a decoder beside the encoder); 32 groups,
    as every released VAE has (the group count is not visible in the shapes)."""
    cls, kwargs = CASES[case]
    ref = _reference(cls, **kwargs, norm_num_groups=32)
    tensors = {}
    for key, value in ref.state_dict().items():
        if key.startswith("encoder."):
            name = _to_ldm(key.removeprefix("encoder."))
            if name.startswith("mid.attn_1.") and value.ndim == 2:
                value = value[:, :, None, None]
            tensors[f"encoder.{name}"] = value.contiguous()
        elif key.startswith(("quant_conv.", "bn.running_")):
            tensors[key] = value.contiguous()
    tensors["decoder.conv_in.weight"] = torch.zeros(1)  # ignored by the encoder's import
    save_file(tensors, str(tmp_path / "ae.safetensors"))
    config, state = flux.convert(tmp_path / "ae.safetensors")
    ours = flux.Encoder(config).eval()
    ours.load_state_dict(state, strict=True)
    x = torch.rand((1, 3, 40, 56), generator=torch.Generator().manual_seed(6)) * 2 - 1
    assert cosine(ours.moments(x), ref.encode(x).latent_dist.parameters) >= 0.99999


def test_decoder_only_checkpoint_is_refused(tmp_path) -> None:
    save_file({"decoder.conv_in.weight": torch.zeros(4, 16, 3, 3)}, str(tmp_path / "d.safetensors"))
    with pytest.raises(ValueError, match="decoder-only"):
        flux.convert(tmp_path / "d.safetensors")
    folder = tmp_path / "pipeline" / "vae"  # a diffusers export whose encoder was dropped
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"_class_name": "AutoencoderKL", "latent_channels": 4}')
    save_file({"decoder.conv_in.weight": torch.zeros(4, 4, 3, 3)}, str(folder / "m.safetensors"))
    with pytest.raises(ValueError, match="decoder-only"):
        flux.convert(folder.parent)


@torch.no_grad()
def test_optimized_copy_stays_at_parity() -> None:
    """``optimize`` (in-place SiLU, Winograd resnet convs at >= 128 channels) on a copy: the
    same moments to the gate's threshold, and the convs really swapped."""
    import copy

    config = {**flux.SYNTHETIC["flux1-synthetic"], "block_out_channels": [128, 128]}
    exact = flux.Encoder(config).eval()
    flux.init_synthetic(exact, torch.Generator().manual_seed(0))
    fast = copy.deepcopy(exact)
    fast.optimize()
    assert type(fast.down_blocks[0].resnets[0].conv1).__name__ == "WinogradConv2d"
    x = torch.rand((1, 3, 48, 72), generator=torch.Generator().manual_seed(7)) * 2 - 1
    assert cosine(fast.moments(x), exact.moments(x)) >= 0.99999
    assert (
        cosine(
            fast.moments(x, tiled=True, tile_sample_size=32),
            exact.moments(x, tiled=True, tile_sample_size=32),
        )
        >= 0.99999
    )


def test_registry_synthetic_and_errors() -> None:
    part = family("flux").encoder
    assert part.module is flux.Encoder and part.init_synthetic is flux.init_synthetic
    config = {
        **family("flux").synthetic["flux1-synthetic"].encoder_config,
        "block_out_channels": [32, 64],
        "norm_num_groups": 8,
    }
    enc = part.module(config).eval()
    part.init_synthetic(enc, torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = enc.probe_input(torch.Generator().manual_seed(0))
        z = enc.encode(x)
    assert z.shape == (1, 16, 32, 32) and torch.isfinite(z).all() and z.std() > 0.05
    assert [name for name, _ in enc.stages()][:3] == ["conv_in", "down_0", "down_1"]
    assert enc.working_bytes((1, 3, 512, 512), 4) > 3 * 32 * 512 * 512 * 4
    with pytest.raises(ValueError, match="expected pixels"):
        enc.moments(torch.zeros(1, 4, 16, 16))
    with pytest.raises(ValueError, match="smaller than one latent cell"):
        enc.moments(torch.zeros(1, 3, 1, 16))
    with pytest.raises(ValueError, match="tile_sample_size"):
        enc.moments(torch.zeros(1, 3, 64, 80), tiled=True, tile_sample_size=7)
    with pytest.raises(ValueError, match="last tile"):  # 48-px steps: a 1-px last strip
        enc.moments(torch.zeros(1, 3, 64, 97), tiled=True, tile_sample_size=64)
    with pytest.raises(KeyError, match="flux"):
        family("nope")
