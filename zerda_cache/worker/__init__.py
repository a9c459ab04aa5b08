"""Everything that runs on a schedule, one leader at a time: decay, eviction, the audit,
match-model fits, index snapshots, and the APScheduler worker that runs them.
"""
