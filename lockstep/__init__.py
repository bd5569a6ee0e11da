"""Lockstep: online diagnosis of slowdowns in large synchronous training jobs."""

__version__ = "0.1.0"
