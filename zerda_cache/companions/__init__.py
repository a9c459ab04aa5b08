"""Companion modules from the seeds: the context guard and adaptive windows, and
prompt guardrails and templates.
"""
