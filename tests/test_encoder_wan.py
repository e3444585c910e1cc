"""The Wan encoders against diffusers' AutoencoderKLWan / AutoencoderKLQwenImage.encode
(random weights, float32): the reference's 1 + 4k frame chunks with its feature cache against
our streamed pass (several chunkings), plain and tiled, Wan 2.1, Wan 2.2 TI2V, Qwen-Image."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

from app.families.wan import encoder as wan
from tests import helpers
from tests.helpers import check_moments, reference_dist, rgb_video


def tiny(z_dim: int, **config: Any) -> dict[str, Any]:
    """A Wan VAE config of base width 8 with identity latent statistics."""
    stats = dict(latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
    return dict(base_dim=8, z_dim=z_dim, **stats, **config)


VARIANTS = {
    "wan2.1": (
        AutoencoderKLWan,
        tiny(4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
             scale_factor_spatial=4),
    ),
    # two resnets a stage, 2-D downsampling first
    "wan2.1-deep": (
        AutoencoderKLWan,
        tiny(4, dim_mult=[1, 2, 2, 2], num_res_blocks=2, temperal_downsample=[False, True, True],
             scale_factor_spatial=8),
    ),
    "wan2.2": (
        AutoencoderKLWan,
        tiny(12, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
             scale_factor_spatial=16, **helpers.WAN22_PATCHED),
    ),
    # the published channel counts (original single files carry no statistics)
    "wan2.1-z16": (
        AutoencoderKLWan,
        tiny(16, dim_mult=[1, 2, 2], num_res_blocks=2, temperal_downsample=[False, True],
             scale_factor_spatial=4),
    ),
    "wan2.2-z48": (
        AutoencoderKLWan,
        tiny(48, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
             scale_factor_spatial=8, **helpers.WAN22_PATCHED),
    ),
    "qwen-image": (
        AutoencoderKLQwenImage,
        tiny(4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True]),
    ),
}  # fmt: skip


def make_pair(name: str):
    cls, kwargs = VARIANTS[name]
    ref = helpers.seeded(cls, **kwargs)
    config = {k: v for k, v in kwargs.items() if k in wan.encode.DEFAULTS}
    if cls is AutoencoderKLQwenImage:
        config["spatial_compression_ratio"] = 2 ** len(kwargs["temperal_downsample"])
    elif "scale_factor_spatial" in kwargs:
        config["spatial_compression_ratio"] = kwargs["scale_factor_spatial"]
    return helpers.encoder_pair(wan, ref, config)


@pytest.mark.parametrize(
    "name,shape,chunk",
    [
        ("wan2.1", (9, 16, 24), 4),
        ("wan2.1", (11, 16, 16), 0),  # 1 + 4k + 2: the last two frames are dropped, as there
        ("wan2.1-deep", (5, 32, 16), 4),
        ("wan2.2", (9, 32, 32), 8),
        ("wan2.2", (1, 32, 64), 16),
        ("qwen-image", (1, 24, 32), 16),
        ("qwen-image", (9, 16, 16), 0),
    ],
)
def test_encode_matches_diffusers(name, shape, chunk):
    helpers.check_encode(
        f"{name} {shape} chunk={chunk}", *make_pair(name), shape, chunk_frames=chunk
    )


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2"])
def test_chunkings_agree(name):
    """Whole clip, 4-frame and 8-frame chunks: the same stream."""
    _, ours = make_pair(name)
    x = rgb_video(17, 32, 32)
    whole = ours.moments(x, chunk_frames=0)
    for chunk in (4, 8):
        torch.testing.assert_close(ours.moments(x, chunk_frames=chunk), whole, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="multiple of 4"):
        ours.moments(x, chunk_frames=6)


@pytest.mark.parametrize(
    "name,size,stride,hw",
    [("wan2.1", 32, 24, (40, 56)), ("wan2.2", 32, 16, (64, 96)), ("qwen-image", 32, 16, (48, 40))],
)
def test_tiled_matches_diffusers(name, size, stride, hw):
    helpers.check_tiled_encode(name, *make_pair(name), rgb_video(5, *hw), size, stride)


def test_attention_in_down_stages_refused():
    """diffusers builds them but its encoder cannot run them (it passes the cache to them)."""
    with pytest.raises(ValueError, match="attn_scales"):
        wan.Encoder({"base_dim": 8, "attn_scales": [0.5]})


def test_image_input_and_normalize():
    _, ours = make_pair("qwen-image")
    x = rgb_video(1, 16, 16)
    torch.testing.assert_close(ours.moments(x[:, :, 0]), ours.moments(x)[:, :, 0])
    enc = wan.Encoder({**ours.config, "latents_mean": [1.0] * 4, "latents_std": [4.0] * 4})
    z = torch.randn(1, 4, 2, 2, 2)
    torch.testing.assert_close(enc.normalize(z), (z - 1.0) / 4.0)


@pytest.mark.parametrize("name", ["wan2.2", "qwen-image"])
def test_convert_diffusers_folder(tmp_path, name):
    ref, ours = make_pair(name)
    x = rgb_video(5, 32, 32)
    config, loaded = helpers.check_folder_import(wan, ref, ours, tmp_path / "vae", x)
    assert config["variant"] == name
    assert (
        loaded.normalize(torch.ones(1, ours.latent_channels, 1, 1, 1)).shape[1]
        == ours.latent_channels
    )


def test_stages_hold_every_parameter_in_order():
    helpers.check_encoder_stages(make_pair("wan2.1")[1])


@pytest.mark.parametrize("name", list(wan.SYNTHETIC))
def test_synthetic_weights(name):
    helpers.check_synthetic_encoder(wan, name)


# --- original single files -------------------------------------------------------------------
RESNET_ORIGINAL = {"norm1.": "residual.0.", "conv1.": "residual.2.", "norm2.": "residual.3.",
                   "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}  # fmt: skip
TOP_ORIGINAL = {"quant_conv.": "conv1.", "encoder.conv_in.": "encoder.conv1.",
                "encoder.mid_block.resnets.0.": "encoder.middle.0.",
                "encoder.mid_block.attentions.0.": "encoder.middle.1.",
                "encoder.mid_block.resnets.1.": "encoder.middle.2.",
                "encoder.norm_out.": "encoder.head.0.",
                "encoder.conv_out.": "encoder.head.2."}  # fmt: skip


def _resnet_original(prefix: str, rest: str) -> str:
    for new, old in RESNET_ORIGINAL.items():
        if rest.startswith(new):
            return prefix + old + rest[len(new) :]
    return prefix + rest


def original_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' encoder names -> the original ``Wan2.x_VAE.pth`` ones (written here from
    the original code's module structure, independently of app/)."""
    out = {}
    for key, value in state.items():
        top = next((k for k in TOP_ORIGINAL if key.startswith(k)), None)
        if top is not None:
            out[_resnet_original(TOP_ORIGINAL[top], key[len(top) :])] = value
            continue
        parts = key.split(".")  # encoder.down_blocks.i.<rest>
        i, rest = parts[2], ".".join(parts[3:])
        if rest.startswith("resnets."):  # Wan 2.2: Down_ResidualBlock.downsamples.j
            j, inner = parts[4], ".".join(parts[5:])
            out[_resnet_original(f"encoder.downsamples.{i}.downsamples.{j}.", inner)] = value
        elif rest.startswith("downsampler."):  # its resample closes the same Sequential
            j = len(
                {
                    k.split(".")[4]
                    for k in state
                    if k.startswith(f"encoder.down_blocks.{i}.resnets.")
                }
            )
            out[f"encoder.downsamples.{i}.downsamples.{j}.{rest[len('downsampler.') :]}"] = value
        else:
            out[_resnet_original(f"encoder.downsamples.{i}.", rest)] = value
    out["decoder.conv1.weight"] = torch.zeros(1)  # the decoder half: dropped by convert
    return out


def test_original_layout_writer_is_diffusers_own():
    """The writer above agrees with diffusers' single-file converter (Wan 2.1 encoder keys)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    ref, _ = make_pair("wan2.1-deep")
    state = {k: v for k, v in ref.state_dict().items() if k.startswith(helpers.ENCODER_PARTS)}
    original = original_layout(state)
    original.pop("decoder.conv1.weight")
    theirs = convert_wan_vae_to_diffusers(original)
    assert set(theirs) == set(state)
    assert all(torch.equal(theirs[k], state[k]) for k in state)


def save_original(state: dict, path) -> None:
    from safetensors.torch import save_file

    original = original_layout(state)
    if path.suffix == ".pth":
        torch.save(original, path)
    else:  # a repack with a prefix, as some single files have
        save_file({f"vae.{k}": v.contiguous() for k, v in original.items()}, str(path))


@pytest.mark.parametrize("name,suffix", [("wan2.1-z16", ".pth"), ("wan2.2-z48", ".safetensors")])
def test_convert_original_single_file(tmp_path, name, suffix):
    """The original layout, its config inferred from the shapes, matches diffusers' encode."""
    ref, ours = make_pair(name)
    path = tmp_path / f"vae{suffix}"
    save_original(ours.state_dict(), path)
    config, loaded_state = wan.convert(path)
    assert config["variant"] == name.split("-")[0]
    assert config["latents_std"][0] != 1.0  # the published statistics
    loaded = helpers.encoder_from(wan, config, loaded_state)
    x = rgb_video(5, 32, 32)
    check_moments(f"{name} original file", loaded.moments(x), reference_dist(ref, x))


def test_original_file_without_published_statistics_refused(tmp_path):
    _, ours = make_pair("wan2.1")
    path = tmp_path / "vae.pth"
    save_original(ours.state_dict(), path)
    with pytest.raises(ValueError, match="published"):
        wan.convert(path)


@pytest.mark.parametrize(
    "config,shape",
    [
        ({}, (1, 3, 33, 256, 256)),
        (wan.SYNTHETIC["wan2.2-tiny"] | {"base_dim": 160}, (1, 3, 17, 256, 256)),
    ],
)
def test_working_bytes_cover_the_measured_peak(config, shape):
    helpers.check_working_bytes(wan, config, shape)


def test_bad_input_is_a_value_error():
    helpers.check_bad_input_refused(wan)
