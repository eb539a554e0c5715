"""Ray job entrypoint for `raychat tokenizer`: `raychat submit tokenizer ARGS` runs `python jobs/tokenizer.py ARGS` on the cluster."""

import sys

from raychat.cli import main

if __name__ == "__main__":
    sys.exit(main(["tokenizer", *sys.argv[1:]]))
