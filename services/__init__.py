"""Poise processes: one package per service (gateway, planner, monitor, migrator, worker, engine_sim)."""
