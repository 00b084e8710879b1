"""What score-teacher.sbatch asks of Python: free ports on this node, and the wait until every
node of the allocation has joined the job's Ray cluster (docs/slurm.md#what-score-teachersbatch-does).

    python deploy/slurm/ray_nodes.py ports 4
    python deploy/slurm/ray_nodes.py wait --address 10.0.0.1:41234 --nodes "gpu01 gpu02" --timeout 300 \
        --log "outputs/slurm/score-teacher-1234/ray-{node}.0.log"

``wait`` knows a Ray node's Slurm node by the ``slurm-node`` label the launcher gives each
``ray start``, not by its address (two Slurm nodes can share one host). On success it prints one
line per node (Slurm name, Ray node id, address); after ``--timeout`` seconds without every node
it prints one line naming the missing ones and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
import time

LABEL = "slurm-node"


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that nothing on this node listens on now (the kernel's choice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


def joined(nodes: list[dict]) -> dict[str, dict]:
    """The alive Ray nodes by their Slurm node name."""
    return {n["Labels"][LABEL]: n for n in nodes if n.get("Alive") and LABEL in (n.get("Labels") or {})}


def wait_for_nodes(address: str, expected: list[str], timeout_s: float) -> dict[str, dict] | None:
    """Poll the cluster at ``address`` until every expected Slurm node has a Ray node, or
    ``timeout_s`` passes (None). The head may still be starting: a refused connection is retried."""
    import ray

    deadline = time.monotonic() + timeout_s
    host, port = address.rsplit(":", 1)
    found: dict[str, dict] = {}
    while time.monotonic() < deadline:
        if not ray.is_initialized():
            try:
                socket.create_connection((host, int(port)), timeout=2).close()  # the head listens
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            except (OSError, RuntimeError):  # not listening yet; ray.init's ConnectionError is an OSError
                time.sleep(1)
                continue
        found = joined(ray.nodes())
        if set(expected) <= set(found):
            return found
        time.sleep(1)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ports = sub.add_parser("ports", help="print free TCP ports of this node")
    ports.add_argument("n", type=int)
    wait = sub.add_parser("wait", help="wait until every Slurm node has joined the Ray cluster")
    wait.add_argument("--address", required=True, help="the head's GCS address, host:port")
    wait.add_argument("--nodes", required=True, help="the allocation's node names, separated by spaces")
    wait.add_argument("--timeout", type=float, required=True, help="seconds")
    wait.add_argument("--log", default="", help="where a node's Ray log is, {node} standing for its name")
    args = parser.parse_args(argv)

    if args.command == "ports":
        print(" ".join(map(str, free_ports(args.n))))
        return 0
    expected = args.nodes.split()
    found = wait_for_nodes(args.address, expected, args.timeout)
    if found is None:
        import ray

        have = joined(ray.nodes()) if ray.is_initialized() else {}
        missing = [n for n in expected if n not in have]
        logs = f"their Ray logs ({', '.join(args.log.format(node=n) for n in missing)}) say why" if args.log else \
            "their Ray logs say why"
        print(f"error: {len(missing)} of {len(expected)} nodes did not join the Ray cluster at {args.address} "
              f"within {args.timeout:g} s: {', '.join(missing)} (joined: {', '.join(sorted(have)) or 'none'}); "
              f"{logs}: most often the environment (VENV) is not at the same path there, or the node cannot "
              "reach the head's port", file=sys.stderr)
        return 2
    for name in expected:
        node = found[name]
        print(f"ray node {name}: {node['NodeID']} at {node['NodeManagerAddress']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
