"""Ray job entrypoint for `raychat speedrun`: `raychat submit speedrun ARGS` runs `python jobs/speedrun.py ARGS` on the cluster."""

import sys

from raychat.cli import main

if __name__ == "__main__":
    sys.exit(main(["speedrun", *sys.argv[1:]]))
