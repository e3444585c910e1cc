"""TAESD family: parity with diffusers' AutoencoderTiny, and TAEF2's real decoder weights
(their round trip on real photos, with TAEF2's real encoder: tests/test_encoder_taesd.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderTiny
from safetensors.torch import save_file

from app.families import ops
from app.families.taesd import decoder as taesd
from app.runtime import modes
from app.telemetry import timing
from app.telemetry.timing import PhaseTimer
from tests.helpers import cosine

SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2 = ("weights", "taef2")


def shared(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path}: ../shared is absent (a user's clone has none)")
    return path


# --- parity with diffusers (plain variant, random weights) -----------------

CASES = {
    # name: (AutoencoderTiny kwargs, latent shape, checkpoint keys: upstream flat or diffusers)
    "taesd-4ch": (dict(latent_channels=4), (1, 4, 12, 16), "upstream"),
    "taef1-16ch-batch2": (dict(latent_channels=16), (2, 16, 8, 10), "diffusers"),
    "narrow-2up": (
        dict(latent_channels=8, num_decoder_blocks=(2, 1, 1), decoder_block_out_channels=(32,) * 3),
        (1, 8, 10, 6),
        "upstream",
    ),
}


def _randomize(ref: AutoencoderTiny) -> AutoencoderTiny:
    """He-scaled weights, residual branches damped: the default init's output is nearly
    constant (std ~0.02), which would make any cosine look perfect."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.decoder.named_parameters():
            std = (2 / p[0].numel()) ** 0.5 if p.ndim == 4 else 0.1
            damp = 0.5 if name.endswith("conv.4.weight") else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * std * damp)
    return ref


def _diffusers_file(ref: AutoencoderTiny, tmp_path: Path, flat: bool) -> Path:
    """The reference's weights as diffusers saves them, or in upstream flat indices."""
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if flat:  # madebyollin's Sequential has the Clamp at index 0: one higher than diffusers
        sd = {
            f"{int(k.split('.')[2]) + 1}.{k.split('.', 3)[3]}": v
            for k, v in sd.items()
            if k.startswith("decoder.layers.")
        }
    path = tmp_path / "weights.safetensors"
    save_file(sd, str(path))
    return path


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_diffusers(case: str, tmp_path: Path) -> None:
    kwargs, shape, keys = CASES[case]
    ref = _randomize(AutoencoderTiny(**kwargs).eval())
    config, sd = taesd.convert(_diffusers_file(ref, tmp_path, keys == "upstream"))
    assert config["latent_channels"] == kwargs["latent_channels"]
    ours = taesd.Decoder(config)
    ours.load_state_dict(sd)
    # the served float32 copy too: channels_last, its up stages' convs by output phase
    served = modes.build(ours.eval(), torch.device("cpu"), modes.Mode(torch.float32))
    assert all(isinstance(stage.conv, ops.PhaseConv) for stage in served.up)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        want = (ref.decode(z).sample + 1) / 2  # diffusers maps [0,1] to [-1,1]; upstream does not
        for label, decoder in (("exact", ours), ("served", served)):
            got = decoder.decode(z)
            cos, err = cosine(got, want), (got - want).abs().max().item()
            centred = cosine(got - want.mean(), want - want.mean())  # a flat output fails
            print(
                f"{case} {label}: cosine {cos:.9f} centred {centred:.9f} max-abs {err:.2e}",
                f"(out std {want.std():.2f})",
            )
            scale = ours.spatial_scale
            assert got.shape == want.shape == (shape[0], 3, shape[2] * scale, shape[3] * scale)
            assert cos >= 0.99999 and centred >= 0.99999 and err < 1e-5 * want.abs().max()


def test_phases_summary_and_errors() -> None:
    dec = taesd.Decoder({"variant": "taef2"}).eval()
    timing.instrument(dec.stages())
    timer = PhaseTimer()
    with torch.no_grad(), timer.active():
        out = dec.decode(dec.probe_latent(torch.Generator().manual_seed(0)))
    assert out.shape == (1, 3, 128, 128)
    assert list(timer.phases()) == ["clamp", "conv_in", "mid", "up_0", "up_1", "up_2", "conv_out"]
    assert dec.summary()["preview"] is True and dec.summary()["output_space"] == "unit"
    with pytest.raises(ValueError, match="latent"):
        dec.decode(torch.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match="variant"):
        taesd.Decoder({"variant": "taesdxl"})


def test_canonical_safetensors_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    dec = taesd.Decoder({"variant": "taef2", "channels": [16] * 3, "blocks": [2, 1, 1]})
    path = tmp_path / "store.safetensors"
    save_file(dec.state_dict(), str(path))
    config, sd = taesd.convert(path)
    assert config == dec.config
    assert all(torch.equal(sd[k], v) for k, v in dec.state_dict().items())


# --- the real TAEF2 weights ------------------------------------------------


@pytest.fixture(scope="module")
def taef2() -> taesd.Decoder:
    config, sd = taesd.convert(shared(*TAEF2, "taef2_decoder.pth"))
    dec = taesd.Decoder(config)
    dec.load_state_dict(sd)
    return dec.eval()


def test_taef2_detected_from_weights_not_name(tmp_path: Path) -> None:
    # A misleading file name: the variant must still come from the pool branch's keys.
    path = tmp_path / "taesd_decoder.pth"
    shutil.copy(shared(*TAEF2, "taef2_decoder.pth"), path)
    config, sd = taesd.convert(path)
    assert config["variant"] == "taef2" and config["latent_channels"] == 32
    assert config["mid_pool_channels"] == 256 and config["blocks"] == [3, 3, 3, 1]
    assert sd["conv_in.weight"].dtype == torch.float16  # import keeps the checkpoint's dtype
    dec = taesd.Decoder(config)
    dec.load_state_dict(sd)
    with torch.no_grad():
        out = dec.eval().decode(
            torch.randn(1, 32, 8, 12, generator=torch.Generator().manual_seed(0))
        )
    assert out.shape == (1, 3, 64, 96) and torch.isfinite(out).all()
