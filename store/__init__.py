"""The store daemon: tiers, the data plane server, heartbeats to the metadata service."""
