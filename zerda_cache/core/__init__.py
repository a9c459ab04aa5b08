"""The values every layer builds on: configuration and tenant settings, the entry and
its bandit arm, errors, input checks, what a call returns, and savings.
"""
