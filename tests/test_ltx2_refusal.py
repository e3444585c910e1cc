"""`python -m app import ltx` refuses LTX-2 checkpoints (it would decode them wrong).

A tiny random ``diffusers.AutoencoderKLLTX2Video`` decoded as LTX-Video 0.9.x measured
cosine 0.68 against diffusers: so every way an LTX-2 checkpoint arrives must be refused,
naming what marked it, and nothing may reach the store.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video
from safetensors.torch import save_file

from app.cli import main
from app.decoders import ltx

_TINY = {
    "latent_channels": 8,
    "block_out_channels": (8, 8, 8, 8),
    "layers_per_block": (1, 1, 1, 1, 1),
    "decoder_block_out_channels": (8, 16, 32),
    "decoder_layers_per_block": (1, 1, 1, 1),
    "decoder_spatio_temporal_scaling": (True, True, True),
    "decoder_inject_noise": (False, False, False, False),
}
TINY_LTX2 = {
    # LTX-2's released decoder in miniature: residual 2x upsamplers, no channel change, so
    # its weights fit an 0.9.x decoder exactly (what was imported and decoded wrong).
    "released": {**_TINY, "upsample_residual": (True,) * 3, "upsample_factor": (2, 2, 2)},
    # channel-changing (factor 1): its diffusers layout has plain conv_shortcut weights
    "factor-1": {**_TINY, "upsample_residual": (False,) * 3, "upsample_factor": (1, 1, 1)},
}
LTX2_ONLY_CONFIG = (
    "_class_name",
    "upsample_type",
    "encoder_spatial_padding_mode",
    "decoder_spatial_padding_mode",
)


@pytest.fixture(scope="module", params=list(TINY_LTX2))
def ltx2(request) -> AutoencoderKLLTX2Video:
    torch.manual_seed(0)
    return AutoencoderKLLTX2Video(**TINY_LTX2[request.param]).eval()


def test_diffusers_folder_is_refused_by_class_name(ltx2, tmp_path):
    ltx2.save_pretrained(tmp_path / "pipe" / "vae")
    with pytest.raises(ValueError, match="_class_name 'AutoencoderKLLTX2Video'"):
        ltx.convert(tmp_path / "pipe")


def test_diffusers_folder_without_its_config_markers_is_refused_by_keys(tmp_path):
    torch.manual_seed(0)
    AutoencoderKLLTX2Video(**TINY_LTX2["factor-1"]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in LTX2_ONLY_CONFIG:
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="plain conv_shortcut weights"):
        ltx.convert(tmp_path)


def _single_file(ltx2: AutoencoderKLLTX2Video, extra: dict[str, torch.Tensor]) -> dict:
    """LTX-2's decoder in Lightricks' original flat ``up_blocks.N`` names (diffusers'
    ``convert_ltx2_vae_to_diffusers`` read backwards), as in ``ltx-2-*.safetensors``."""
    original = {"mid_block.": "up_blocks.0."}
    for i in range(3):
        original[f"up_blocks.{i}.upsamplers.0."] = f"up_blocks.{2 * i + 1}."
        original[f"up_blocks.{i}."] = f"up_blocks.{2 * i + 2}."
    tensors = {}
    for key, value in ltx2.decoder.state_dict().items():
        for new, old in original.items():
            if key.startswith(new):
                key = old + key[len(new) :]
                break
        tensors["vae.decoder." + key.replace("resnets.", "res_blocks.")] = value.contiguous()
    tensors["vae.per_channel_statistics.mean-of-means"] = torch.zeros(8)
    tensors["vae.per_channel_statistics.std-of-means"] = torch.ones(8)
    return {**tensors, **extra}


def test_single_file_with_audio_vae_is_refused(ltx2, tmp_path):
    path = tmp_path / "ltx-2-19b-dev.safetensors"
    audio = {"audio_vae.per_channel_statistics.mean-of-means": torch.zeros(8)}
    save_file(_single_file(ltx2, audio), str(path))
    with pytest.raises(ValueError, match="tensors under 'audio_vae.'"):
        ltx.convert(path)


def test_single_file_with_reflect_padding_config_is_refused(ltx2, tmp_path):
    path = tmp_path / "ltx-2-vae.safetensors"
    meta = {"vae": {"decoder_spatial_padding_mode": "reflect", "patch_size": 4}}
    save_file(_single_file(ltx2, {}), str(path), metadata={"config": json.dumps(meta)})
    with pytest.raises(ValueError, match="decoder_spatial_padding_mode='reflect'"):
        ltx.convert(path)


def test_cli_import_refuses_and_stores_nothing(ltx2, tmp_path):
    ltx2.save_pretrained(tmp_path / "vae")
    store = tmp_path / "models"
    argv = ["import", "ltx", str(tmp_path / "vae"), "--name", "ltx2", "--models-dir", str(store)]
    with pytest.raises(ValueError, match="LTX-2 .*AutoencoderKLLTX2Video"):
        main(argv)
    assert not (store / "ltx2").exists()
