"""deploy/prometheus/alerts.yml for another scrape job, or for Cloud Run's Managed Prometheus.

    python scripts/render_alerts.py --job JOB [-o OUT]            # a self-hosted job name
    python scripts/render_alerts.py --cloud-run SERVICE [-o OUT]  # Managed Prometheus sidecar

Every selector of the rules names the scrape job, ``job="vae"`` (deploy/prometheus/prometheus.yml).
Cloud Run's sidecar (run-gmp-sidecar) reports ``job="run-gmp-sidecar"`` for every service that
uses it, so there the service is told apart by the sidecar's ``service_name`` label (the Cloud
Run service's name). deploy/prometheus/alerts-cloudrun.yml is ``--cloud-run vae-render``; the
output imports into Cloud Monitoring as alerting policies (deploy/README.md). Stdlib only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ALERTS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yml"
SELF_HOSTED_JOB = 'job="vae"'
SIDECAR_JOB = "run-gmp-sidecar"  # what run-gmp-sidecar sets on every series it exports
_PLAIN = re.compile(r"[A-Za-z0-9_.:/-]+")


def _selector(job: str | None, service: str | None) -> str:
    if (job is None) == (service is None):
        raise ValueError("give one of job and service")
    name = job if job is not None else service
    if not _PLAIN.fullmatch(name or ""):
        raise ValueError(f"not a plain name: {name!r}")
    if job is not None:
        return f'job="{job}"'
    return f'job="{SIDECAR_JOB}", service_name="{service}"'


def render(text: str, job: str | None = None, service: str | None = None) -> str:
    """The rules with every ``job="vae"`` selector replaced (a job name, or a Cloud Run service
    behind the Managed Prometheus sidecar)."""
    if SELF_HOSTED_JOB not in text:
        raise ValueError(f"{SELF_HOSTED_JOB} not found: alerts.yml changed, update this script")
    selector = _selector(job, service)
    lines = [
        line if line.lstrip().startswith("#") else line.replace(SELF_HOSTED_JOB, selector)
        for line in text.splitlines(keepends=True)
    ]
    header = (
        f"# GENERATED from alerts.yml by scripts/render_alerts.py for {selector}: do not edit.\n"
    )
    return header + "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--job", help="the job label of the service's series (self-hosted)")
    target.add_argument("--cloud-run", metavar="SERVICE", help="the Cloud Run service's name")
    parser.add_argument("-o", "--output", type=Path, help="default: stdout")
    args = parser.parse_args(argv)
    text = render(ALERTS.read_text(), job=args.job, service=args.cloud_run)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
