"""The documented environment variables are the ones the service reads (issue 37.4): every
``Settings`` field is in README's configuration tables, every ``VAE_*`` variable a table
documents is a ``Settings`` field, and no module of ``app/`` reads a ``VAE_*`` variable
itself (``app/config.py`` is the one place)."""

from __future__ import annotations

import re
from pathlib import Path

from app.config import Settings

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `([A-Z][A-Z0-9_]+)` \|", re.M)
RAW_READ = re.compile(r"""(?:environ(?:\.get)?[\[(]|getenv\()\s*["'](VAE_[A-Z0-9_]+)""")


def documented() -> set[str]:
    """The variables of README's tables (a row per variable: ``| `VAE_X` | default | ...``)."""
    return set(ROW.findall((ROOT / "README.md").read_text()))


def read_by_settings() -> set[str]:
    names = set()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        names.add(alias if isinstance(alias, str) else f"VAE_{name.upper()}")
    return names


def test_every_setting_is_documented_and_every_documented_variable_is_a_setting():
    docs, settings = documented(), read_by_settings()
    assert not settings - docs, f"read by Settings, not in README's tables: {settings - docs}"
    vae_docs = {name for name in docs if name.startswith("VAE_")}
    assert not vae_docs - settings, f"in README's tables, read by no setting: {vae_docs - settings}"


def test_no_module_reads_a_vae_variable_outside_settings():
    readers = {}
    for path in (ROOT / "app").rglob("*.py"):
        if path.name == "config.py" and path.parent.name == "app":
            continue
        found = RAW_READ.findall(path.read_text())
        if found:
            readers[str(path.relative_to(ROOT))] = found
    assert not readers, f"read outside app/config.py: {readers}"


def test_the_checks_see_what_they_look_for():
    assert ROW.findall("| `VAE_X` | 1 | x |\n| `PORT` | 8080 | y |") == ["VAE_X", "PORT"]
    assert RAW_READ.findall('os.environ.get("VAE_A") os.getenv("VAE_B") os.environ["VAE_C"]') == [
        "VAE_A",
        "VAE_B",
        "VAE_C",
    ]


def test_a_field_read_alone_is_read_in_any_case_as_settings_reads_it(monkeypatch):
    """``Settings`` reads ``vae_log_format``; the readers that run before it (logging, the
    command line) read the same variable, not only its upper-case spelling."""
    from app.config import Settings, given, setting

    monkeypatch.setenv("vae_log_format", "json")
    assert Settings().log_format == "json" == setting("log_format") and given("log_format")
