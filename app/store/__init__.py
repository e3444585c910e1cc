"""The model store: one folder per entry, published whole by one atomic pointer.

Layout (README, "Model store health")::

    DIR/NAME -> .entries/NAME@<version>      a relative symlink: the entry's one atomic pointer
    DIR/.entries/NAME@<version>/manifest.json, decoder.safetensors[, encoder.safetensors]
    DIR/.locks/NAME.lock                      flock: one writer per name at a time

A writer builds a new version folder completely (weights, manifest, fsynced), then swaps the
symlink with a rename: a crash at any point leaves the old entry or the new one, never a mix;
unpublished versions are removed by the next writer of that name. Stores of the older flat
layout (``DIR/NAME/manifest.json`` + ``decoder.safetensors``) load as they are, and the next
write upgrades them atomically. ``import`` converts a checkpoint once into canonical
safetensors; ``serve`` memory-maps them (nothing on the load path unpickles).

Links: the store follows one kind, its own entry link, and only to ``.entries/NAME@...`` (its
literal target is checked). Any other link below the root (``.entries``, a version folder, a
manifest or part file, ``.locks`` or a lock file) refuses the entry by name; part files are
plain names inside the entry. The root itself is the operator's path and may be a link.
"""

from app.store.files import (
    ENTRIES,
    LOCKS,
    MANIFEST,
    NAME_RE,
    PART_FILES,
    PAUSE_ENV,
    WEIGHTS,
    StoreError,
    check_name,
    entry_dir,
)
from app.store.manifest import Manifest, public_source, sha256_file
from app.store.meta import (
    PairError,
    check_pair,
    check_shapes,
    checked_meta_build,
    meta_module,
    read_header,
)
from app.store.read import (
    list_models,
    load_encoder,
    load_model,
    load_part,
    part_path,
    read_manifest,
    verify_entry,
    verify_part,
)
from app.store.write import entry_lock, write_model

__all__ = [
    "ENTRIES",
    "LOCKS",
    "MANIFEST",
    "NAME_RE",
    "PART_FILES",
    "PAUSE_ENV",
    "WEIGHTS",
    "Manifest",
    "PairError",
    "StoreError",
    "check_name",
    "check_pair",
    "check_shapes",
    "checked_meta_build",
    "entry_dir",
    "entry_lock",
    "list_models",
    "load_encoder",
    "load_model",
    "load_part",
    "meta_module",
    "part_path",
    "public_source",
    "read_header",
    "read_manifest",
    "sha256_file",
    "verify_entry",
    "verify_part",
    "write_model",
]
