"""Container HEALTHCHECK: exit 0 when GET /readyz on $PORT answers 200 (stdlib only)."""

import os
import sys
import urllib.error
import urllib.request

url = f"http://127.0.0.1:{os.environ.get('PORT', '8080')}/readyz"
try:
    with urllib.request.urlopen(url, timeout=4) as response:
        sys.exit(0 if response.status == 200 else 1)
except (urllib.error.URLError, OSError) as exc:
    print(f"not ready: {exc}", file=sys.stderr)
    sys.exit(1)
