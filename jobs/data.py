"""Ray job entrypoint for `raychat data`: `raychat submit data ARGS` runs `python jobs/data.py ARGS` on the cluster."""

import sys

from raychat.cli import main

if __name__ == "__main__":
    sys.exit(main(["data", *sys.argv[1:]]))
