"""Ray job entrypoint for `raychat rl`: `raychat submit rl ARGS` runs `python jobs/rl.py ARGS` on the cluster."""

import sys

from raychat.cli import main

if __name__ == "__main__":
    sys.exit(main(["rl", *sys.argv[1:]]))
