"""Poise load generator: replay LLM request traces against an OpenAI-compatible endpoint.

Owns trace reading, synthetic workloads, the timed streaming replay client, SLO
definitions, latency metrics and report writing. Nothing here imports the serving
stack, so benchmarks measure Poise (or any baseline) strictly from the outside.
"""
