"""deploy/prometheus/alerts.yml for a scrape job other than the self-hosted ``vae``.

    python scripts/render_alerts.py --job JOB [-o OUT]

The rules select ``up`` by its ``job`` label, which is the scrape job's name: ``vae`` in
deploy/prometheus/prometheus.yml, but whatever the collector reports under Managed Prometheus
on Cloud Run (look it up in Metrics Explorer: the ``job`` label of ``vae_queue_depth``). The
output imports into Cloud Monitoring as alerting policies (deploy/README.md). Stdlib only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ALERTS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yml"
SELF_HOSTED_JOB = 'job="vae"'


def render(text: str, job: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.:/-]+", job):
        raise ValueError(f"not a plain job name: {job!r}")
    if SELF_HOSTED_JOB not in text:
        raise ValueError(f"{SELF_HOSTED_JOB} not found: alerts.yml changed, update this script")
    return text.replace(SELF_HOSTED_JOB, f'job="{job}"')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="the job label of the service's series")
    parser.add_argument("-o", "--output", type=Path, help="default: stdout")
    args = parser.parse_args(argv)
    text = render(ALERTS.read_text(), args.job)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
