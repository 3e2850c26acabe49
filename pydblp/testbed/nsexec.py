"""``python -m pydblp.testbed.nsexec NETNS_PATH CMD...``: exec CMD inside a netns.

The fallback of :meth:`Testbed.argv` where ``nsenter`` is missing.  Only the
network namespace changes, so /sys and /sys/fs/bpf stay those of the host.
"""

import os
import sys

from pydblp.net import CLONE_NEWNET, _libc


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m pydblp.testbed.nsexec NETNS_PATH CMD [ARG...]")
    fd = os.open(sys.argv[1], os.O_RDONLY)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        sys.exit(f"setns {sys.argv[1]} failed (needs root)")
    os.close(fd)
    os.execvp(sys.argv[2], sys.argv[2:])


if __name__ == "__main__":
    main()
