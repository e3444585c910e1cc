"""Model store and `python -m app import/bake`: layouts, manifests, refusal of bad entries."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file

from app.families import family
from app.store import StoreError, check_name, list_models, load_model, sha256_file
from tests import launch
from tests.conftest import ROOT

# 32 groups: BFL's code hard-codes them, so a single file cannot say otherwise
CFG = dict(
    latent_channels=16,
    block_out_channels=(32, 64, 64),
    layers_per_block=1,
    norm_num_groups=32,
    use_quant_conv=False,
    use_post_quant_conv=False,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
)


def _bfl_name(key: str, n_up: int) -> str:
    """diffusers -> Black Forest Labs / LDM names, written independently of app/ as the spec."""
    fixed = {
        "decoder.mid_block.resnets.0": "decoder.mid.block_1",
        "decoder.mid_block.resnets.1": "decoder.mid.block_2",
        "decoder.mid_block.attentions.0.group_norm": "decoder.mid.attn_1.norm",
        "decoder.mid_block.attentions.0.to_q": "decoder.mid.attn_1.q",
        "decoder.mid_block.attentions.0.to_k": "decoder.mid.attn_1.k",
        "decoder.mid_block.attentions.0.to_v": "decoder.mid.attn_1.v",
        "decoder.mid_block.attentions.0.to_out.0": "decoder.mid.attn_1.proj_out",
        "decoder.conv_norm_out": "decoder.norm_out",
    }
    for ours, bfl in fixed.items():
        if key.startswith(ours + "."):
            return bfl + key[len(ours) :]
    parts = key.split(".")
    if parts[1] == "up_blocks":
        i = n_up - 1 - int(parts[2])
        if parts[3] == "resnets":
            rest = ".".join(parts[5:]).replace("conv_shortcut", "nin_shortcut")
            return f"decoder.up.{i}.block.{parts[4]}.{rest}"
        return f"decoder.up.{i}.upsample.{'.'.join(parts[5:])}"
    return key


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One set of weights in two layouts: a diffusers folder and a BFL ae.safetensors."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(3)
    ref = AutoencoderKL(**CFG).eval()
    ref.save_pretrained(root / "pipeline" / "vae")
    bfl = {}
    for key, value in ref.state_dict().items():
        name = _bfl_name(key, 3)
        if ".attn_1." in name and name.endswith("weight") and "norm" not in name:
            value = value[:, :, None, None]  # BFL keeps q/k/v/proj_out as 1x1 convs
        bfl[name] = value.contiguous()
    save_file(bfl, str(root / "ae.safetensors"))
    return root, ref


def _app(*args: str, store) -> subprocess.CompletedProcess:
    return launch.run(
        [sys.executable, "-m", "app", *args, "--models-dir", str(store)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bfl_layout_imports_identically_to_diffusers_folder(checkpoints, tmp_path):
    root, ref = checkpoints
    assert (
        _app(
            "import",
            "flux",
            str(root / "pipeline"),
            "--name",
            "from-folder",
            "--no-references",
            store=tmp_path,
        ).returncode
        == 0
    )
    done = _app(
        "import",
        "flux",
        str(root / "ae.safetensors"),
        "--name",
        "from-bfl",
        "--no-references",
        store=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    _, a = load_model(tmp_path, "from-folder")
    _, b = load_model(tmp_path, "from-bfl")
    assert a.config["block_out_channels"] == b.config["block_out_channels"] == [32, 64, 64]
    assert not any(k.startswith("encoder") for k in a.state_dict())  # decoder only
    z = torch.randn(1, 16, 5, 7)
    with torch.no_grad():
        expected = ref.decode(z).sample
        assert torch.equal(a.decode(z), b.decode(z))
        assert (a.decode(z) - expected).abs().max() < 1e-5


def test_manifest_records_family_dtype_source_and_hash(checkpoints, tmp_path):
    root, _ = checkpoints
    done = _app(
        "import",
        "flux",
        str(root / "ae.safetensors"),
        "--name",
        "half",
        "--dtype",
        "bfloat16",
        "--no-references",
        store=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "half" / "manifest.json").read_text())
    assert manifest["family"] == "flux" and manifest["dtype"] == "bfloat16"
    assert manifest["source"].endswith("ae.safetensors")
    assert manifest["sha256"] == sha256_file(tmp_path / "half" / "decoder.safetensors")
    _, decoder = load_model(tmp_path, "half", verify=True)
    assert next(decoder.parameters()).dtype == torch.bfloat16


def test_bake_is_deterministic(tmp_path):
    # both bakes at once, without the gate references (a full-size FLUX.1 decode each, a
    # separate file: test_startup.py's bake test covers them): the weights are the point
    bake = [sys.executable, "-m", "app", "bake", "--synthetic", "--no-references"]
    bake += ["--only", "flux1-synthetic"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    runs = [
        launch.popen([*bake, "--models-dir", str(tmp_path / s)], cwd=ROOT, **pipes)
        for s in ("a", "b")
    ]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    sums = [
        json.loads((tmp_path / s / "flux1-synthetic" / "manifest.json").read_text())["sha256"]
        for s in ("a", "b")
    ]
    assert sums[0] == sums[1]
    _, decoder = load_model(tmp_path / "a", "flux1-synthetic")
    assert decoder.config["block_out_channels"] == [128, 256, 512, 512]  # FLUX.1 at full size


def test_bad_entries_are_named(tmp_path, checkpoints):
    root, _ = checkpoints
    good = ["--name", "good", "--no-references"]
    _app("import", "flux", str(root / "ae.safetensors"), *good, store=tmp_path)
    (tmp_path / "good" / "decoder.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(StoreError, match="good"):
        load_model(tmp_path, "good")
    for bad in ("../etc", "a/b", "", ".hidden"):
        with pytest.raises(StoreError):
            check_name(bad)


def test_an_import_of_what_the_family_does_not_read_is_one_error_line(
    tmp_path, capsys, monkeypatch
):
    """No traceback for a path, a family or a file that is wrong: one line naming it."""
    from app import cli

    monkeypatch.setattr("app.telemetry.logs.configure_logging", lambda: None)
    encoder = tmp_path / "taesd_encoder.pth"  # madebyollin's layout: its first conv takes RGB
    torch.save({"0.weight": torch.zeros(64, 3, 3, 3), "0.bias": torch.zeros(64)}, encoder)
    runs_code = tmp_path / "evil_decoder.pth"  # torch's own message advises weights_only=False
    torch.save({"x": Fraction(1, 3)}, runs_code)
    truncated = tmp_path / "cut_decoder.pth"
    truncated.write_bytes(encoder.read_bytes()[:200])
    empty = tmp_path / "empty_decoder.pth"
    empty.touch()
    nan = tmp_path / "nan.safetensors"  # imported, it made every decode a 422 blaming the latent
    taesd = family("taesd")
    weights = taesd.decoder.module(dict(taesd.synthetic["taesd-seeded"].config)).state_dict()
    weights[next(iter(weights))][0] = float("nan")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(nan))
    cases = {
        ("taesd", tmp_path / "missing.pth"): "missing.pth: no such file or folder",
        ("nosuch", encoder): "unknown family 'nosuch'; known: flux,",
        ("taesd", encoder): "is not a taesd checkpoint that import reads: taesd: an encoder's",
        ("flux", tmp_path): "is not a flux checkpoint that import reads: [Errno 2]",
        ("taesd", runs_code): "import reads: a pickle that runs code (refused)",
        ("taesd", truncated): "is not a taesd checkpoint that import reads: ",
        ("taesd", empty): "is not a taesd checkpoint that import reads: EOFError",
        ("flux", runs_code): "is not a flux checkpoint that import reads: ",
        ("taesd", nan): "nan.safetensors: weights hold NaN or infinity (",
    }
    for (key, source), words in cases.items():
        argv = ["import", key, str(source), "--name", "x", "--models-dir", str(tmp_path)]
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        err = capsys.readouterr().err
        assert done.value.code == 1 and err.startswith("error: ") and words in err, err
        assert err.count("\n") == 1 and "weights_only" not in err and "\x1b" not in err, err
    # the name is checked before the checkpoint is read
    argv = ["import", "taesd", str(encoder), "--name", "../x", "--models-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 1 and err.startswith("error: import refused: invalid model name")
    assert err.count("\n") == 1, err
    assert not list_models(tmp_path)
    with pytest.raises(SystemExit) as done:  # bake of a name no recipe has: said, not silent
        cli.main(["bake", "--synthetic", "--only", "nosuch", "--models-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert done.value.code == 1 and err.startswith("error: no embedded model named nosuch (known:")


# The loader as the image's unprivileged user: Python and torch load as root (this machine's
# interpreter may sit in root's home), then the process drops to uid/gid 65534 (nobody), and
# only then opens the store, as the service does.
UNPRIVILEGED_LOADER = """
import json, os, sys
import safetensors.torch  # noqa: F401  (imported while still root)
from app.families import families
from app.store import list_models, load_model
families()  # every family's modules imported while still root
os.setgroups([]); os.setgid(65534); os.setuid(65534)
store, loaded = sys.argv[1], {}
for name in list_models(store):
    try:
        load_model(store, name, verify=True)
        loaded[name] = "ok"
    except Exception as exc:
        loaded[name] = repr(exc)
print(json.dumps(loaded))
"""


def test_a_store_baked_by_root_loads_as_an_unprivileged_user():
    """The image bakes /models as root and serves as uid 10001; safetensors writes 0600.
    Baked under a strict umask, every entry must still load for another user."""
    if os.geteuid() != 0:
        pytest.skip("needs root to bake as one user and load as another")
    holder = Path(tempfile.mkdtemp(prefix="store-"))  # the image's /: traversable by anyone
    try:
        holder.chmod(0o711)
        store = holder / "models"
        bake = [sys.executable, "-m", "app", "bake", "--synthetic", "--models-dir", str(store)]
        done = subprocess.run([*bake, "--only", "ltx-tiny", "minimax-h3-tiny"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              preexec_fn=lambda: os.umask(0o077))  # fmt: skip
        assert done.returncode == 0, done.stderr
        for folder, dirs, files in os.walk(store):  # versions, locks: all readable by anyone
            for path in [Path(folder) / d for d in dirs] + [Path(folder) / f for f in files]:
                need = 0o555 if path.is_dir() and not path.is_symlink() else 0o444
                assert path.is_symlink() or path.stat().st_mode & need == need, path
        done = launch.run([sys.executable, "-c", UNPRIVILEGED_LOADER, str(store)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        loaded = json.loads(done.stdout.strip().splitlines()[-1])
        assert loaded == {"ltx-tiny": "ok", "minimax-h3-tiny": "ok"}, loaded
    finally:
        shutil.rmtree(holder)


# --- an entry's encoder gives the latent its decoder takes ---------------------------------


def _embedded_pairs():
    from app.families import families

    for described in families().values():
        for name, recipe in described.synthetic.items():
            if recipe.encoder_config is not None:
                yield pytest.param(described, recipe, id=name)


@pytest.mark.parametrize(("described", "recipe"), list(_embedded_pairs()))
def test_every_embedded_encoder_s_latent_decodes_to_its_input_size(described, recipe):
    """A clip (or image) encoded then decoded comes back at its own size: two latent frames
    and cells of the encoder's own scales, random pixels, the seeded modules as baked."""
    encoder = described.encoder.module(recipe.encoder_config).eval()
    decoder = described.decoder.module(recipe.config).eval()
    side = 2 * encoder.spatial_scale
    frames = (1 + encoder.temporal_scale,) if encoder.is_video else ()
    x = torch.rand(1, 3, *frames, side, side) * 2 - 1
    with torch.no_grad():
        z = encoder.encode(x)
        assert z.shape[1] == decoder.latent_channels, (z.shape, decoder.summary())
        y = decoder.decode(z)
    assert tuple(y.shape[2:]) == tuple(x.shape[2:]), (tuple(z.shape), tuple(y.shape))


def _mismatched(store: Path) -> None:
    """ltx-tiny's decoder stored with ltx2-tiny's encoder (x16 in space and x4 in time, where
    the decoder is x32 and x8)."""
    from app.families import family
    from app.store.write import write_model

    ltx = family("ltx")
    decoder, encoder = ltx.synthetic["ltx-tiny"], ltx.synthetic["ltx2-tiny"]
    decoder_state = ltx.decoder.module(decoder.config).state_dict()
    encoder_state = ltx.encoder.module(encoder.encoder_config).state_dict()
    write_model(store, "pair", "ltx", decoder.config, decoder_state, "test", "float32",
                encoder_state, encoder.encoder_config)  # fmt: skip


def test_an_encoder_of_another_latent_is_refused_when_written_and_when_loaded(
    tmp_path, monkeypatch
):
    with pytest.raises(StoreError, match=r"x16 in space, x4 in time\) is not the decoder's"):
        _mismatched(tmp_path)
    assert not list_models(tmp_path)  # nothing published
    from app.store import write

    with monkeypatch.context() as patch:  # what a writer before the check stored
        patch.setattr(write, "check_pair", lambda *args: None)
        _mismatched(tmp_path)
    from app.config import Settings
    from app.runtime import Runtime
    from app.telemetry.metrics import Metrics

    runtime = Runtime(Settings(models_dir=tmp_path, device="cpu", dtype="float32"), Metrics())
    runtime.load_all()
    assert "pair" in runtime.models and "pair" not in runtime.encoders  # the decoder serves
    assert "is not the decoder's" in runtime.encoder_errors["pair"]
