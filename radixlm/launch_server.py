"""``python -m radixlm.launch_server [flags]``: the same as ``radixlm serve`` (SGLang's
entry point name)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # imported here: the server's spawned children import this module again (as the main
    # module), and they need none of the command line's imports
    from radixlm.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
