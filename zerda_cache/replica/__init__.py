"""A replica's in-memory vector indexes: the search structures and each tenant's index
with its builds, snapshots, catch-up and readiness.
"""
