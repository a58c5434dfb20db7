"""Exec probe of a reaper pod: is its loop still turning?

The reaper touches ``Settings.reaper_alive_file`` after every try at a pass, whether it
holds the deployment's reaper lease (and reaped) or stands by, so the file is never older
than one interval plus a pass while the loop runs. A reaper stuck (a pass hung on a dead
connection, for one) leaves it older: restarted, it gives the lease up to a standby, or
the lease lapses.
"""

import sys
import time

from orchestrator.config import get_settings

PASS_ALLOWANCE_S = 120.0
"""How long one pass may take before its reaper counts as stuck."""


def main() -> int:
    settings = get_settings()
    alive = settings.reaper_alive_file
    if not alive.exists():
        print("the reaper has not finished a first try yet")
        return 1
    age = time.time() - alive.stat().st_mtime
    limit = 3 * settings.reaper_interval_s + PASS_ALLOWANCE_S
    if age > limit:
        print(f"the reaper last turned {age:.0f} s ago (limit {limit:.0f} s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
