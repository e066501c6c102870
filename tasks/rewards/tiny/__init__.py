"""Tiny random reward models of real architectures, built in-process for tests (experts/hub.py `tiny:`)."""
