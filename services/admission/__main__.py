from services.core.loop import run
from services.core.parent import follow_parent

follow_parent()

from services.admission.app import main  # noqa: E402

run(main())
