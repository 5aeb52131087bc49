"""The planner: leader-elected loop that asks a pool policy for role changes and has the sidecars carry them out."""
