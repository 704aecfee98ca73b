"""Measurement harnesses that only ``benchmarks/`` scripts and the tests use.

They live beside the scripts rather than in the package: no user of the library needs them.
A script run as ``python benchmarks/NAME.py`` has this folder's parent on ``sys.path``; the
tests add it in ``tests/conftest.py``.
"""
