"""Hexagram compress."""
