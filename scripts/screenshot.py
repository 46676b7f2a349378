"""Render a report in headless Chromium and save a screenshot for review.

    python scripts/screenshot.py results/study/report.html results/study/report.png

Needs Debian's `chromium` (apt-get install chromium); no network is used.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 3:
        sys.stderr.write("usage: screenshot.py REPORT.html OUT.png\n")
        return 2
    report, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.stderr.write("error: chromium not found (apt-get install chromium)\n")
        return 2
    if not report.exists():
        sys.stderr.write(f"error: {report} does not exist\n")
        return 2
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--no-first-run", "--hide-scrollbars",
                    "--window-size=1200,9000", f"--screenshot={out}", report.as_uri()],
                   check=True, capture_output=True, timeout=120)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
