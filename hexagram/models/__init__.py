"""Hexagram models."""
