"""Ray job entrypoint for `raychat export`: `raychat submit export ARGS` runs `python jobs/export.py ARGS` on the cluster."""

import sys

from raychat.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
