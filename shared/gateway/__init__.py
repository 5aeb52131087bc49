"""Pure, clock-free gateway model that the live gateway and the simulator share: admission (hold, place,
refuse) and the in-flight ledger, in shared/gateway/model.py (imported from there, not re-exported)."""
