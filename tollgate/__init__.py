"""Tollgate client SDK and command line."""
