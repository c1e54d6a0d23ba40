"""`python -m services.ledger`, configured by `TOLLGATE_*` variables (docs/CONFIGURATION.md)."""

from services.core.parent import follow_parent

follow_parent()

from services.core.server import run_service  # noqa: E402
from services.ledger.app import LedgerSettings, main  # noqa: E402

run_service("ledger", LedgerSettings.from_env, main)
