"""What the cache learns and decides with: the bandit, a tenant's policy, the error
bound's calibration and match model, and the tenant's stored state read through storage.
"""
