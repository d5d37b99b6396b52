"""``vertexrt local-run``: a Vertex job of N replicas on this machine (see :mod:`.cli`): the replica
environments, the output relay, the supervisor that signals, tears down and restarts as Vertex would."""
