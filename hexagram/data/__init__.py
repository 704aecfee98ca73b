"""Hexagram data."""
