"""What one call does: the engine's lookup, put, feedback and upkeep flows, composed from
the layers below, and export and import.
"""
