"""`python -m app import ltx` and LTX-2: what is imported, and what is still refused.

LTX-2 (``AutoencoderKLLTX2Video``) decoded as LTX-Video 0.9.x measured cosine 0.68 against
diffusers, so an LTX-2 checkpoint must be recognised and imported as ``version: ltx2`` (parity:
tests/test_ltx2.py), and whatever cannot be decoded exactly must be refused, naming what was
seen, with nothing reaching the store.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video
from safetensors.torch import save_file

from app.cli import main
from app.families.ltx import decoder as ltx
from app.store import load_model
from tests.helpers import seeded
from tests.test_ltx2 import AUDIO_PARTS, lightricks_file

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
    # LTX-2's released decoder in miniature: residual 2x upsamplers, no channel change
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


def tiny(variant: str = "released") -> AutoencoderKLLTX2Video:
    """A ``TINY_LTX2`` VAE, its random weights seeded with 0."""
    return seeded(AutoencoderKLLTX2Video, **TINY_LTX2[variant])


@pytest.fixture(scope="module", params=list(TINY_LTX2))
def ltx2(request) -> AutoencoderKLLTX2Video:
    return tiny(request.param)


# --- imported -----------------------------------------------------------------------------
def test_cli_imports_a_diffusers_folder_as_ltx2(ltx2, tmp_path):
    ltx2.save_pretrained(tmp_path / "pipe" / "vae")
    store = tmp_path / "models"
    with pytest.raises(SystemExit, match="0"):
        main(["import", "ltx", str(tmp_path / "pipe"), "--name", "l2", "--models-dir", str(store)])
    manifest, decoder = load_model(store, "l2")
    assert manifest.family == "ltx" and manifest.config["version"] == "ltx2"
    assert decoder.version == "ltx2"
    z = torch.randn(1, 8, 2, 2, 3)
    with torch.no_grad():
        expected = ltx2.decode(z).sample
    got = decoder.decode(z)
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), 0) > 0.99999


def test_full_single_file_imports_the_video_decoder_only(tmp_path):
    """ltx-2-*.safetensors: transformer, video VAE, audio VAE, vocoder; only the video
    decoder's tensors reach the state dict."""
    ref = tiny()
    tensors, meta = lightricks_file(ref, AUDIO_PARTS)
    save_file(tensors, str(tmp_path / "ltx-2.safetensors"), metadata=meta)
    config, state = ltx.convert(tmp_path / "ltx-2.safetensors")
    assert config["version"] == "ltx2"
    assert not [k for k in state if "audio" in k or "vocoder" in k or "encoder" in k]


# --- still refused ------------------------------------------------------------------------
def test_folder_with_ltx2_weights_but_no_class_name_is_refused(tmp_path):
    tiny("factor-1").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in LTX2_ONLY_CONFIG:
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="plain conv_shortcut weights.*without _class_name"):
        ltx.convert(tmp_path)


@pytest.mark.parametrize("name", ["AutoencoderKLLTX2Audio", "LTX2Vocoder"])
def test_audio_vae_or_vocoder_folder_is_refused(name, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": name}))
    save_file({"decoder.conv_in.weight": torch.zeros(1)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=f"{name}.*audio side"):
        ltx.convert(tmp_path)


def test_single_file_with_audio_parts_only_is_refused(tmp_path):
    path = tmp_path / "ltx-2-audio.safetensors"
    save_file({k: v for k, v in AUDIO_PARTS.items() if not k.startswith("model.")}, str(path))
    with pytest.raises(ValueError, match="only LTX-2 audio parts.*'audio_vae.', 'vocoder.'"):
        ltx.convert(path)


def _ltx2_file(ltx2, tmp_path, vae: dict | None, extra: dict | None = None):
    tensors, meta = lightricks_file(ltx2, {**AUDIO_PARTS, **(extra or {})})
    if vae is not None:
        meta = {"config": json.dumps({"vae": {**json.loads(meta["config"])["vae"], **vae}})}
    path = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file(tensors, str(path), metadata=meta if vae != {} else None)
    return path


def test_single_file_without_its_config_is_refused(tmp_path):
    ref = tiny()
    with pytest.raises(ValueError, match="tensors under 'audio_vae.'.*without its embedded"):
        ltx.convert(_ltx2_file(ref, tmp_path, {}))


@pytest.mark.parametrize(
    "vae,match",
    [
        ({"_class_name": "CausalDiffusionVAE"}, "'CausalDiffusionVAE' VAE"),
        ({"norm_layer": "group_norm"}, "norm_layer 'group_norm'"),
    ],
)
def test_single_file_other_vaes_are_refused(vae, match, tmp_path):
    ref = tiny()
    with pytest.raises(ValueError, match=match):
        ltx.convert(_ltx2_file(ref, tmp_path, vae))


def test_single_file_with_res_x_y_or_attention_blocks_is_refused(tmp_path):
    ref = tiny()
    blocks = json.loads(lightricks_file(ref)[1]["config"])["vae"]["decoder_blocks"]
    vae = {"decoder_blocks": [["res_x_y", {"multiplier": 2}], ["attn", {}], *blocks]}
    with pytest.raises(ValueError, match="'attn' .*'res_x_y' \\(its norm3 is GroupNorm"):
        ltx.convert(_ltx2_file(ref, tmp_path, vae))


def test_unknown_decoder_tensors_are_refused(tmp_path):
    ref = tiny()
    extra = {"vae.decoder.up_blocks.2.res_blocks.0.mystery.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="unexpected.*mystery"):
        ltx.convert(_ltx2_file(ref, tmp_path, None, extra))


def test_cli_refusal_stores_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("app.telemetry.logs.configure_logging", lambda: None)
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_class_name": "LTX2Vocoder"}))
    store = tmp_path / "models"
    argv = ["import", "ltx", str(tmp_path / "vae"), "--name", "voc", "--models-dir", str(store)]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 1 and "audio side" in capsys.readouterr().err
    assert not (store / "voc").exists()
