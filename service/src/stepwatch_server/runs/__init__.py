"""Runs: the read API over stored runs."""
