"""Poise's shared library: the floor every process imports.

Owns configuration helpers, the wire protocol (NATS subjects, etcd keys, message types), the bus and
registry clients, the latency model and the scheduling policies. Policies (``shared.policies``) are pure:
they import nothing that does I/O.
"""
