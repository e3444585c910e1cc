"""TAESD-family encoders: parity with diffusers' AutoencoderTiny encode, TAEF2's real encoder
against madebyollin's layout, and the real-photo round trip through TAEF2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderTiny
from PIL import Image
from safetensors.torch import save_file

from app.families.taesd import decoder as taesd_decoders
from app.families.taesd import encoder as taesd
from tests.helpers import cosine, psnr
from tests.taef2_encoder import load_encoder

SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2 = SHARED / "weights" / "taef2"

CASES = {
    # name: (AutoencoderTiny kwargs, checkpoint layout: madebyollin's flat or diffusers')
    "taesd-4ch": (dict(latent_channels=4), "upstream"),
    "taef1-16ch": (dict(latent_channels=16), "diffusers"),
    "narrow-3-stages": (
        dict(latent_channels=8, num_encoder_blocks=(1, 2, 1), encoder_block_out_channels=(32,) * 3),
        "upstream",
    ),
}
SHAPES = [(1, 3, 64, 64), (2, 3, 48, 80), (1, 3, 61, 90)]  # odd sizes: stride-2 convs ceil


def shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path}: ../shared is absent (a user's clone has none)")
    return path


def _reference(**kwargs) -> AutoencoderTiny:
    """He-scaled encoder weights with damped residual branches (the default init's output is
    nearly constant, which would make any cosine look perfect)."""
    ref = AutoencoderTiny(**kwargs).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.encoder.named_parameters():
            std = (2 / p[0].numel()) ** 0.5 if p.ndim == 4 else 0.1
            damp = 0.5 if name.endswith("conv.4.weight") else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * std * damp)
    return ref


def _imported(ref: AutoencoderTiny, tmp_path: Path, layout: str) -> taesd.Encoder:
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if layout == "upstream":  # madebyollin's encoder Sequential: diffusers' indices, no prefix
        sd = {k.removeprefix("encoder.layers."): v for k, v in sd.items() if ".layers." in k}
        sd = {k: v for k, v in sd.items() if k.split(".")[0].isdigit()}
    path = tmp_path / "encoder.safetensors"
    save_file(sd, str(path))
    config, state = taesd.convert(path)
    ours = taesd.Encoder(config).eval()
    ours.load_state_dict(state, strict=True)
    return ours


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    kwargs, layout = CASES[request.param]
    ref = _reference(**kwargs)
    return ref, _imported(ref, tmp_path_factory.mktemp(request.param), layout)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@torch.no_grad()
def test_latent_matches_diffusers(pair, shape) -> None:
    ref, ours = pair
    x = torch.rand(shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
    expected = ref.encode(x).latents
    got = ours.moments(x)
    assert got.shape == expected.shape
    assert cosine(got, expected) >= 0.99999
    assert ours.encode(x, sample=True).equal(got)  # deterministic: no distribution to sample
    assert expected.std() > 0.1  # the weights make a non-trivial latent


@torch.no_grad()
def test_tiled_encode_matches_enable_tiling(tmp_path) -> None:
    """diffusers' AutoencoderTiny tiles (4-channel latents only: its tile buffer has 4),
    128 px tiles on a 200x328 input; they differ from the untiled latent. Narrow (16 wide):
    the tiles, not the widths, are under test."""
    ref = _reference(latent_channels=4, encoder_block_out_channels=(16,) * 4)
    ours = _imported(ref, tmp_path, "diffusers")
    x = torch.rand((1, 3, 200, 328), generator=torch.Generator().manual_seed(2)) * 2 - 1
    untiled = ref.encode(x).latents
    ref.enable_tiling()
    ref.tile_sample_min_size, ref.tile_latent_min_size = 128, 16
    expected = ref.encode(x).latents
    got = ours.moments(x, tiled=True, tile_sample_size=128)
    assert got.shape == expected.shape
    assert cosine(got, expected) >= 0.99999
    assert cosine(untiled, expected) < 0.9999
    with pytest.raises(ValueError, match="tile_sample_size"):
        ours.moments(x, tiled=True, tile_sample_size=64)  # a 1-cell ramp: diffusers' NaNs


def test_decoder_checkpoint_is_refused(tmp_path) -> None:
    ref = _reference(latent_channels=4)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if k.startswith("decoder.")}
    save_file(sd, str(tmp_path / "decoder.safetensors"))
    with pytest.raises(ValueError):
        taesd.convert(tmp_path / "decoder.safetensors")


def test_synthetic_variants() -> None:
    for name, config in taesd.SYNTHETIC.items():
        enc = taesd.Encoder(config).eval()
        taesd.init_synthetic(enc, torch.Generator().manual_seed(0))
        with torch.no_grad():
            z = enc.encode(enc.probe_input(torch.Generator().manual_seed(0)))
        assert z.shape == (1, enc.latent_channels, 8, 8), name
        assert torch.isfinite(z).all() and z.std() > 0.05, name
    assert taesd.Encoder({"variant": "taef2"}).config["pool_channels"] == [0, 0, 0, 256]


# --- TAEF2's real encoder ----------------------------------------------------


@pytest.fixture(scope="module")
def taef2() -> tuple[taesd.Encoder, taesd_decoders.Decoder]:
    config, state = taesd.convert(shared(TAEF2 / "taef2_encoder.pth"))
    assert config["variant"] == "taef2" and config["pool_channels"] == [0, 0, 0, 256]
    encoder = taesd.Encoder(config)
    encoder.load_state_dict(state)
    dconfig, dstate = taesd_decoders.convert(TAEF2 / "taef2_decoder.pth")
    decoder = taesd_decoders.Decoder(dconfig)
    decoder.load_state_dict(dstate)
    return encoder.float().eval(), decoder.float().eval()


def _photo(name: str) -> np.ndarray:
    return np.array(Image.open(shared(SHARED / "data" / name)).convert("RGB"))


@torch.no_grad()
def test_taef2_real_encoder_matches_madebyollins_layout(taef2) -> None:
    """diffusers' AutoencoderTiny has no pool branch: the oracle is the checkpoint's own flat
    Sequential (tests/taef2_encoder.py), which reads [0, 1] pixels."""
    encoder, _ = taef2
    reference = load_encoder(TAEF2 / "taef2_encoder.pth")
    x = torch.from_numpy(_photo("chelsea.png")).permute(2, 0, 1)[None].float() / 255
    got = encoder.encode(x * 2 - 1)
    assert cosine(got, reference(x)) >= 0.99999


@pytest.mark.parametrize("photo", ["astronaut.png", "chelsea.png", "coffee.png"])
@torch.no_grad()
def test_taef2_real_photo_round_trip(taef2, photo) -> None:
    encoder, decoder = taef2
    img = _photo(photo)
    x = torch.from_numpy(img).permute(2, 0, 1)[None].float() / 127.5 - 1
    h, w = x.shape[-2:]
    x = F.pad(x, (0, -w % 8, 0, -h % 8), mode="replicate")
    z = encoder.encode(x)
    y = decoder.decode(z)[..., :h, :w]
    assert z.shape[1:] == (32, x.shape[-2] // 8, x.shape[-1] // 8)
    # TAEF2 works in FLUX.2's normalized latent space: roughly zero-mean, unit-scale.
    assert abs(z.mean()) < 0.2 and 0.5 < z.std() < 1.5
    assert decoder.output_space == "unit"  # [0, 1] up to a small overshoot, before clamping
    assert -0.2 < y.min() and y.max() < 1.2
    out = (decoder.to_unit(y) * 255).round().to(torch.uint8)[0].permute(1, 2, 0).numpy()
    score = psnr(out, img)
    print(f"{photo} {w}x{h}: TAEF2 round trip PSNR {score:.2f} dB, latent std {z.std():.3f}")
    assert score >= 28.0
