from services.core.infra_process import follow_parent
from services.core.loop import run

follow_parent()

from services.admission.app import main  # noqa: E402

run(main())
