"""Ray job entrypoint for `raychat pretrain`: `raychat submit pretrain ARGS` runs `python jobs/pretrain.py ARGS` on the cluster."""

import sys

from raychat.cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
