"""Tiny random reward models of real architectures, built in-process for tests (common/tiny.py `tiny:`)."""
