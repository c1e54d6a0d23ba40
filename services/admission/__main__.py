"""`python -m services.admission`, configured by `TOLLGATE_*` variables (docs/CONFIGURATION.md)."""

from services.core.parent import follow_parent

follow_parent()

from services.admission.app import AdmissionSettings, main  # noqa: E402
from services.core.server import run_service  # noqa: E402

run_service("admission", AdmissionSettings.from_env, main)
