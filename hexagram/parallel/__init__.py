"""Hexagram parallel."""
