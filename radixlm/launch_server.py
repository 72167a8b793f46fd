"""``python -m radixlm.launch_server [flags]``: the same as ``radixlm serve`` (SGLang's
entry point name)."""

from __future__ import annotations

import sys

from radixlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
