"""Commands shared by sandbox tests."""

# A process that escapes its command (setsid) and keeps every free slot of the sandbox's
# pids limit taken, so nothing else (not even the exec agent's next command) can fork.
PIDS_FILLER = (
    "python3 -c 'import os, time\n"
    "if os.fork():\n"
    "    time.sleep(0.5); os._exit(0)\n"
    "os.setsid()\n"
    "while True:\n"
    "    try:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(600); os._exit(0)\n"
    "    except OSError:\n"
    "        time.sleep(0.005)' >/dev/null 2>&1"
)
