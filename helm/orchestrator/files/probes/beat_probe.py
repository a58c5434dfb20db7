"""Exec probe of the beat pod: is beat still ticking?

Beat keeps its schedule in ``<state_dir>/beat-<deployment>.schedule*`` (a shelve) and
writes it back after sending a task once ``sync_every`` (180 s) has passed, so with the
reaper due every ``reaper_interval_s`` the file is never older than about 180 s plus one
interval while beat works. A beat that stopped sending tasks (stuck on a dead broker
connection, for one) leaves it older.
"""

import sys
import time
from pathlib import Path

from orchestrator.config import get_settings

SYNC_EVERY_S = 180.0


def main() -> int:
    settings = get_settings()
    files = list(settings.state_dir.glob(f"beat-{settings.deployment}.schedule*"))
    if not files:
        print("no schedule file yet")
        return 1
    age = time.time() - max(Path(f).stat().st_mtime for f in files)
    limit = SYNC_EVERY_S + 3 * settings.reaper_interval_s + 60
    if age > limit:
        print(f"schedule written {age:.0f} s ago (limit {limit:.0f} s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
