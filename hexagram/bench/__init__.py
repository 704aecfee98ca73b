"""Hexagram bench."""
