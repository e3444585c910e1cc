"""The hunyuan-video family against diffusers 0.42.1 (the oracle): ``AutoencoderKLHunyuanVideo``,
random weights, float32 CPU.

diffusers decodes HunyuanVideo in overlapping frame windows by default (more than 4 latent
frames: windows of 5 every 3, blended over 4 output frames) and, with ``enable_tiling``, in
blended spatial tiles; each path is compared against the reference doing the same. Each config
is ``save_pretrained`` and imported with ``hunyuan_video.convert``, so the converter is on the
path of every parity number; the original checkpoint layout (Tencent's ``pytorch_model.pt``:
``{"state_dict": {"vae.decoder...": ...}}``) is written by hand from the same weights.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo
from safetensors.torch import save_file

from app.families import family
from app.families.hunyuan_video import decoder as hunyuan_video
from app.families.hunyuan_video.decoder import fast
from app.families.hunyuan_video.decoder.model import Upsampler
from app.runtime import modes
from app.store import load_model
from tests import helpers
from tests.helpers import check, cosine, import_pair, seeded, synthetic_twins
from tests.live import import_pretrained

CONFIGS = {
    # the released topology (4 up blocks: space in 0-2, time in 1-2) in miniature
    "base": dict(latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
                 norm_num_groups=4),
    # 16 latent channels, 3 resnets per up block, 8 groups, a conv shortcut in every block
    "wide": dict(latent_channels=16, block_out_channels=(4, 8, 16, 24), layers_per_block=2,
                 norm_num_groups=4),
    # 3 up blocks (space in all three, time in the first two), no mid attention
    "three-no-attn": dict(latent_channels=4, block_out_channels=(8, 8, 16), layers_per_block=1,
                          norm_num_groups=8, mid_block_add_attention=False,
                          down_block_types=("HunyuanVideoDownBlock3D",) * 3,
                          up_block_types=("HunyuanVideoUpBlock3D",) * 3),
}  # fmt: skip
# (batch, latent frames, h, w): one pass (T <= 4) and windowed (T > 4: 2, 3 and 4 windows,
# the last of one latent frame contributing nothing)
SHAPES = [(1, 1, 3, 4), (1, 3, 3, 4), (2, 5, 2, 3), (1, 7, 3, 2), (1, 10, 2, 2)]


latent = partial(helpers.latent, seed=1)  # seed 1 unless a test says otherwise


@torch.no_grad()
def reference(name: str, seed: int = 0) -> AutoencoderKLHunyuanVideo:
    """A random diffusers VAE: default init, GroupNorm affines made non-trivial."""
    vae = seeded(AutoencoderKLHunyuanVideo, seed, **CONFIGS[name])
    for pname, p in vae.decoder.named_parameters():
        if "norm" in pname and pname.endswith("weight"):
            p.uniform_(0.5, 1.5)
        elif "norm" in pname and pname.endswith("bias"):
            p.normal_(0, 0.2)
    return vae


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    """name -> (diffusers VAE, our decoder imported from its saved folder, config)."""
    return {
        name: import_pair(reference(name), hunyuan_video, tmp_path_factory.mktemp(name))
        for name in CONFIGS
    }


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@torch.no_grad()
def test_decode_matches_diffusers_default(pairs, name, shape):
    """diffusers' default decode (frame windows past 4 latent frames), streamed or not."""
    ref, ours, config = pairs[name]
    b, t, h, w = shape
    z = latent(b, config["latent_channels"], t, h, w)
    expected = helpers.checked_reference_decode(ref, ours, z)
    check(f"{name} {shape}", ours.decode(z), expected)
    streamed = torch.cat(list(ours.iter_decode(z)), 2)
    assert torch.equal(streamed, ours.decode(z))


@pytest.mark.parametrize("t", [5, 7])
@torch.no_grad()
def test_windows_are_really_there(pairs, t):
    """``windowed=False`` is diffusers with ``use_framewise_decoding`` off (one pass over the
    clip), and differs from the default: GroupNorm and the causal attention span the window."""
    ref, ours, config = pairs["base"]
    z = latent(1, config["latent_channels"], t, 2, 3, seed=7)
    ref.use_framewise_decoding = False
    try:
        whole = ref.decode(z).sample
    finally:
        ref.use_framewise_decoding = True
    got = ours.decode(z, windowed=False)
    check(f"one pass T={t}", got, whole)
    assert cosine(got, ours.decode(z)) < 0.9999


@pytest.mark.parametrize(
    "t,chunks",
    [(5, [13, 4]), (6, [13, 8]), (7, [13, 12]), (10, [13, 12, 12]), (11, [13, 12, 12, 4])],
)
@torch.no_grad()
def test_stream_yields_windows_in_order(pairs, t, chunks):
    ref, ours, config = pairs["base"]
    z = latent(1, config["latent_channels"], t, 2, 2, seed=2)
    got = list(ours.iter_decode(z))
    assert [c.shape[2] for c in got] == chunks
    check(f"streamed T={t}", torch.cat(got, 2), ref.decode(z).sample)


@torch.no_grad()
def test_other_window_sizes_match_diffusers(pairs):
    """``window_frames`` / ``window_stride`` are diffusers' tile_sample_(min|stride)_num_frames."""
    ref, ours, config = pairs["base"]
    z = latent(1, config["latent_channels"], 6, 2, 2, seed=8)
    ref.enable_tiling(tile_sample_min_num_frames=8, tile_sample_stride_num_frames=4)
    try:
        expected = ref.decode(z).sample  # spatial tiles stay off: 2x2 cells fit in a tile
    finally:
        ref.disable_tiling()
        ref.tile_sample_min_num_frames, ref.tile_sample_stride_num_frames = 16, 12
    got = ours.decode(z, window_frames=8, window_stride=4)
    check("windows 8/4", got, expected)
    assert cosine(got, ours.decode(z)) < 0.9999


@pytest.mark.parametrize("name", ["base", "wide"])
@pytest.mark.parametrize("t", [2, 6])
@torch.no_grad()
def test_tiled_matches_diffusers_tiled(pairs, name, t):
    """Our tiles and in-place blends are diffusers' ``tiled_decode``'s (4-cell latent tiles
    every 3 cells), alone (T=2) and inside frame windows (T=6)."""
    ref, ours, config = pairs[name]
    size, stride = 32, 24
    ref.enable_tiling(size, size, None, stride, stride, None)
    try:
        z = latent(1, config["latent_channels"], t, 5, 7, seed=3)
        expected = ref.decode(z).sample
    finally:
        ref.disable_tiling()
    got = ours.decode(z, tiled=True, tile_sample_size=size, tile_sample_stride=stride)
    check(f"{name} tiled T={t}", got, expected)
    untiled = ours.decode(z)
    assert cosine(untiled, expected) < 0.9999  # the tiles are really there (seams differ)
    assert torch.equal(ours.decode(z, tiled=False), untiled)
    streamed = ours.iter_decode(z, tiled=True, tile_sample_size=size, tile_sample_stride=stride)
    assert torch.equal(torch.cat(list(streamed), 2), got)


# --- the fast path (served behind the gate) -------------------------------------------------------
@pytest.mark.parametrize("temporal", [True, False], ids=["time+space", "space"])
@pytest.mark.parametrize("frames", [1, 2, 3])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
@torch.no_grad()
def test_phase_upsampler_is_the_upsampler(temporal, frames, layout):
    """Nearest upsampling + the causal replicate-padded conv, computed per output phase on the
    low-res grid: the same sums (float64: to rounding), in either memory layout."""
    torch.manual_seed(frames)
    up = Upsampler(5, temporal, spatial=True).double().to(memory_format=layout)
    x = torch.randn(2, 5, frames, 4, 6, dtype=torch.float64).contiguous(memory_format=layout)
    got = fast.PhaseUpsampler(up)(x)
    expected = up(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert got.is_contiguous(memory_format=layout)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_served_copy_matches_diffusers(pairs, name):
    """The optimized float32 copy (phase upsamplers, Winograd where it suits) decodes as
    diffusers does, windowed and tiled; every spatial upsampler is swapped."""
    ref, ours, config = pairs[name]
    served = modes.build(ours, torch.device("cpu"), modes.Mode(torch.float32))
    ups = [b.upsamplers[0] for b in served.up_blocks if b.upsamplers is not None]
    assert ups and all(isinstance(u, fast.PhaseUpsampler) for u in ups)
    z = latent(1, config["latent_channels"], 6, 5, 7, seed=5)
    check(f"{name} served", served.decode(z), helpers.checked_reference_decode(ref, ours, z))
    ref.enable_tiling(32, 32, None, 24, 24, None)
    try:
        expected = ref.decode(z).sample
    finally:
        ref.disable_tiling()
    size = dict(tile_sample_size=32, tile_sample_stride=24)
    check(f"{name} served tiled", served.decode(z, tiled=True, **size), expected)


@torch.no_grad()
def test_image_latent_is_one_frame(pairs):
    ref, ours, config = pairs["base"]
    z = latent(1, config["latent_channels"], 1, 4, 5, seed=4)
    expected = ref.decode(z).sample[:, :, 0]
    check("4-D", ours.decode(z[:, :, 0]), expected)


def test_denormalize_is_the_pipelines(pairs):
    """HunyuanVideoPipeline: ``latents / vae.config.scaling_factor``."""
    ref, ours, config = pairs["base"]
    z = latent(1, config["latent_channels"], 2, 2, 2, seed=5)
    assert ref.config.scaling_factor == config["scaling_factor"] == 0.476986
    assert torch.equal(ours.denormalize(z), z / ref.config.scaling_factor)


def test_geometry(pairs):
    for name in CONFIGS:
        ours = pairs[name][1]
        assert (ours.spatial_scale, ours.temporal_scale) == (8, 4), name
        assert ours.frames_out(33) == 129
    names = [n for n, _ in pairs["base"][1].stages()]
    assert names == ["conv_in", "conv_in", "mid", "up_0", "up_1", "up_2", "up_3"] + ["conv_out"] * 3


# --- original checkpoints ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["base", "three-no-attn"])
@pytest.mark.parametrize("as_folder", [True, False], ids=["folder", "file"])
@torch.no_grad()
def test_convert_original_checkpoint(pairs, tmp_path, name, as_folder):
    ref, ours, config = pairs[name]
    torch.save(helpers.hunyuan_original_checkpoint(ref), tmp_path / "pytorch_model.pt")
    (tmp_path / "config.json").write_text(json.dumps(helpers.hunyuan_original_config(ref)))
    source = tmp_path if as_folder else tmp_path / "pytorch_model.pt"
    got_config, got_state = hunyuan_video.convert(source)
    assert got_config == config
    assert got_state.keys() == ours.state_dict().keys()
    decoder = hunyuan_video.Decoder(got_config).eval()
    decoder.load_state_dict(got_state)
    z = latent(1, config["latent_channels"], 5, 2, 2, seed=6)
    check(f"{name} original", decoder.decode(z), ref.decode(z).sample)


@torch.no_grad()
def test_convert_single_file_without_config(tmp_path):
    """A lone repack (``hunyuan_video_vae_bf16.safetensors``, no ``vae.``): the config comes
    from the shapes and the published values (32 groups, 8x space, 4x time)."""
    ref = seeded(
        AutoencoderKLHunyuanVideo,
        3,
        latent_channels=16,
        block_out_channels=(32, 32, 32, 32),
        layers_per_block=1,
    )
    path = tmp_path / "hunyuan_video_vae.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    config, state = hunyuan_video.convert(path)
    assert config["norm_num_groups"] == 32 and config["layers_per_block"] == 1
    assert config["block_out_channels"] == [32, 32, 32, 32]
    decoder = hunyuan_video.Decoder(config).eval()
    decoder.load_state_dict(state)
    z = latent(1, 16, 2, 2, 2, seed=9)
    check("lone safetensors", decoder.decode(z), ref.decode(z).sample)
    # widths 32 groups do not divide: refused, named (its config.json would say the groups)
    three = AutoencoderKLHunyuanVideo(**CONFIGS["three-no-attn"])
    save_file({k: v.contiguous() for k, v in three.state_dict().items()}, str(path))
    with pytest.raises(ValueError, match=r"num_channels \(16\) must be divisible by num_groups"):
        hunyuan_video.convert(path)
    # an upsampler where the published placement has none (16x space): needs its config.json
    x16 = AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8),
                                    norm_num_groups=4, spatial_compression_ratio=16)  # fmt: skip
    save_file({k: v.contiguous() for k, v in x16.state_dict().items()}, str(path))
    with pytest.raises(ValueError, match=r"up blocks \[0, 1, 2, 3\], .* in \[0, 1, 2\]; put its"):
        hunyuan_video.convert(path)


# --- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw,match",
    [
        ({"_class_name": "AutoencoderKLHunyuanVideo15"}, "'AutoencoderKLHunyuanVideo15' is not a"),
        ({"_class_name": "AutoencoderKLWan"}, "'AutoencoderKLWan' is not a HunyuanVideo VAE"),
        ({"_class_name": "AutoencoderKLHunyuanVideo", "temporal_compression_ratio": 8},
         "temporal compression 8"),
        ({"_class_name": "AutoencoderKLHunyuanVideo", "up_block_types": ["UpDecoderBlock2D"] * 4},
         "up_block_types .*UpDecoderBlock2D"),
        ({"_class_name": "AutoencoderKLHunyuanVideo", "act_fn": "gelu"}, "act_fn 'gelu'"),
    ],
)  # fmt: skip
def test_refuses_foreign_configs(tmp_path, raw, match):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        hunyuan_video.convert(tmp_path)


def test_refuses_unknown_missing_and_misshaped_keys(pairs, tmp_path):
    ref, _, _ = pairs["base"]
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    (tmp_path / "config.json").write_text(json.dumps(helpers.hunyuan_original_config(ref)))
    path = tmp_path / "pytorch_model.safetensors"
    save_file({**state, "decoder.up_blocks.0.resnets.0.extra.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="unexpected .*extra.weight"):
        hunyuan_video.convert(path)
    save_file({**state, "loss.discriminator.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="no HunyuanVideo VAE part: .*loss.discriminator"):
        hunyuan_video.convert(path)
    save_file({k: v for k, v in state.items() if k != "decoder.conv_out.conv.bias"}, str(path))
    with pytest.raises(ValueError, match="missing .*conv_out.conv.bias"):
        hunyuan_video.convert(path)
    bad = {**state, "decoder.conv_out.conv.weight": torch.zeros(3, 8, 1, 3, 3)}
    save_file(bad, str(path))
    with pytest.raises(ValueError, match="wrong shape .*conv_out.conv.weight"):
        hunyuan_video.convert(path)
    save_file({"decoder.conv_in.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="not a HunyuanVideo VAE"):
        hunyuan_video.convert(path)


def test_refuses_a_pickle_that_needs_code(tmp_path):
    path = tmp_path / "pytorch_model.pt"
    torch.save({"state_dict": {"vae.x": torch.zeros(1)}, "obj": Path("x")}, path)
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        hunyuan_video.convert(path)


# --- the store and the synthetic model -------------------------------------------------------------
@torch.no_grad()
def test_cli_import_into_the_store(pairs, tmp_path):
    ref, _, config = pairs["wide"]
    import_pretrained(tmp_path / "store", "hunyuan-video", {"hy": ref})  # --no-references
    manifest, decoder = load_model(tmp_path / "store", "hy", verify=True)
    assert not list((tmp_path / "store").rglob("*gate_reference*")), "references were computed"
    assert manifest.family == "hunyuan-video" and manifest.config == config
    assert family("hunyuan-video").decoder.module is hunyuan_video.Decoder
    z = latent(1, 16, 5, 2, 2, seed=10)
    check("store entry", decoder.decode(z), ref.decode(z).sample)


def test_synthetic_is_deterministic_and_gates_in_bf16():
    config = hunyuan_video.SYNTHETIC["hunyuan-video-tiny"]
    a, b = synthetic_twins(hunyuan_video, config, seed=0)
    json.dumps(config)
    z = a.probe_latent(torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = a.eval().decode(z)
        fast = b.eval().to(torch.bfloat16).decode(z.to(torch.bfloat16))
    check("hunyuan-video-tiny bf16 vs fp32 (gate probe)", fast.float(), exact, min_cos=0.9999)
