"""Comparison harness entry point (README's demo command)."""

from __future__ import annotations

import sys


def main() -> int:
    print("the comparison harness is not built yet (see the comparison-harness issue)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
