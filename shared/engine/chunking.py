"""Which prefill chunk an engine runs with in each role: one rule for Poise's worker, which launches engines,
and the simulator, which models them."""

from __future__ import annotations

from shared.protocol.messages import Role


def role_chunk_tokens(chunk_tokens: int | None, role: Role) -> int | None:
    """The chunk an engine of ``role`` runs with, given the chunk its settings ask for (None: the engine's
    default; 0 or less: no chunking). A colocated engine keeps its default chunk where the others prefill
    whole prompts: operator preemption replaces the chunk on a prefill engine, but in a colocated engine's
    mixed steps a whole prompt would delay every running request's next token."""
    if role == "null" and chunk_tokens is not None and chunk_tokens <= 0:
        return None
    return chunk_tokens
