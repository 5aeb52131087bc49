"""The worker sidecar: launches or attaches to one engine, registers it in etcd, reports its load, flips its role."""
