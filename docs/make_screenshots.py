"""Screenshot every HTML report of a demo run into docs/figures/ (the README's pictures), checking each page first.

    make screenshots          # runs the demo into build/screenshots-demo, then this script on its reports
    .venv/bin/python -m docs.make_screenshots DEMO_OUT/reports

Each page is opened in headless Chromium at 1280 px wide (tests/browser.py) and must pass the same checks as
tests/pipelines/test_reports_in_browser.py: no console error, every image decoded, no sideways scrolling. A page
that fails stops the script with the problems listed, so a broken page never becomes a README picture.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.browser import check_page, chromium

OUT = Path(__file__).resolve().parent / "figures"
PREFIX = "report-"  # docs/figures/report-<report name>.png, e.g. report-lr-range-test-first.png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", type=Path, help="a demo's reports folder (OUT/reports)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where the PNG files go (default {OUT})")
    args = ap.parse_args(argv)
    pages = sorted(args.reports.glob("*.html"))
    if not pages:
        print(f"no HTML reports in {args.reports}; run the demo first (make screenshots does)", file=sys.stderr)
        return 1
    failed = False
    with chromium() as browser:
        for page in pages:
            shot = args.out / f"{PREFIX}{page.stem}.png"
            check = check_page(browser, page, screenshot=shot)
            problems = check.problems()
            if problems:
                failed = True
                shot.unlink(missing_ok=True)
                print(f"{page.name}: " + "; ".join(problems), file=sys.stderr)
            else:
                print(f"{shot} ({len(check.images)} images, {check.scroll_width} px wide)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
