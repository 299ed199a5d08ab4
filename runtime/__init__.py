"""Registered memory, transports (verbs, tcp, shm), wire formats and the node agent; installed as tinyhet.runtime."""
