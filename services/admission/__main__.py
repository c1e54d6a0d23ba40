import asyncio

from services.core.infra_process import follow_parent

follow_parent()

from services.admission.app import main  # noqa: E402

asyncio.run(main())
