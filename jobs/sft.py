"""Ray job entrypoint for `raychat sft`: `raychat submit sft ARGS` runs `python jobs/sft.py ARGS` on the cluster."""

import sys

from raychat.cli import main

if __name__ == "__main__":
    sys.exit(main(["sft", *sys.argv[1:]]))
