"""Ray job entrypoint for `raychat eval`: `raychat submit eval ARGS` runs `python jobs/eval.py ARGS` on the cluster."""

import sys

from raychat.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
