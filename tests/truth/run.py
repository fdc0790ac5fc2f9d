"""Run the truth oracle over the zoo and print one table (model x check).

    python -m tests.truth.run            # every architecture
    python -m tests.truth.run --fast     # the subset `make test` runs
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from .oracle import CHECKS, cell, check_case
from .zoo import FAST, ZOO


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", action="store_true")
    ap.add_argument("names", nargs="*")
    args = ap.parse_args(argv)
    names = args.names or (FAST if args.fast else list(ZOO))
    warnings.filterwarnings("ignore")
    rows, bad = [], 0
    for name in names:
        t = time.perf_counter()
        try:
            res = check_case(ZOO[name])
            cells = [cell(res, c) for c in CHECKS]
            verdict = "ok" if res.passed else "FAIL"
            why = res.failures[:3]
        except Exception as exc:  # a case that cannot run is a failure of the harness run
            cells, verdict, why = ["-"] * len(CHECKS), "ERROR", [repr(exc)[:200]]
        bad += verdict != "ok"
        rows.append([name, *cells, verdict, f"{time.perf_counter() - t:.1f}s"])
        for w in why:
            print(f"  {name}: {w}", file=sys.stderr)
    head = ["model", *CHECKS, "verdict", "time"]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(v).ljust(w) for v, w in zip(r, widths)) + " |"
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    print("cells: ok/checked; n/oN: edges recorded as not observed, with their reason")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
