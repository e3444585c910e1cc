"""Build-time check: the image's torch build can run on the target's NVIDIA driver.

    python scripts/check_torch_cuda.py DRIVER_CUDA     # e.g. 12.2: Cloud Run's L4 driver (535)

DRIVER_CUDA is the newest CUDA version the target's driver supports (nvidia-smi's "CUDA
Version"). A torch built for a newer CUDA *major* cannot start there. Within one major, CUDA's
minor-version compatibility runs a 12.8 build on a 12.2 driver (>= 525), so that passes.
A CPU-only torch fails too: the GPU image would decode on the CPU. Exit status 1 on a problem.
"""

from __future__ import annotations

import sys


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.strip().partition(".")
    return int(major), int(minor.partition(".")[0] or 0)


def problem(torch_cuda: str | None, driver_cuda: str) -> str | None:
    """Why a torch built for ``torch_cuda`` cannot run on a ``driver_cuda`` driver, or None."""
    if not torch_cuda:
        return "torch is a CPU-only build; the GPU image needs a CUDA build (TORCH_INDEX_URL)"
    built, driver = _version(torch_cuda), _version(driver_cuda)
    if built[0] > driver[0]:
        return (
            f"torch is built for CUDA {torch_cuda}, newer than the target driver's CUDA "
            f"{driver_cuda}: install it from a cu{driver[0]}x index "
            f"(e.g. https://download.pytorch.org/whl/cu{driver[0]}8)"
        )
    return None


def main(argv: list[str]) -> int:
    import torch

    driver_cuda = argv[1] if len(argv) > 1 else "12.2"
    found = problem(torch.version.cuda, driver_cuda)
    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, target driver CUDA "
          f"{driver_cuda}: {'FAIL: ' + found if found else 'ok'}")  # fmt: skip
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
