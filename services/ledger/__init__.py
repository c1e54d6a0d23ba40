"""The ledger service: bills terminal runs exactly once and reports on what was billed."""
