from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.services.admission.running import Admission, running_admission


@pytest.fixture
async def admission(
    database_url: str, kafka_bootstrap: str, kafka_topic: str, tiny_model_dir: Path
) -> AsyncIterator[Admission]:
    async with running_admission(
        database_url, kafka_bootstrap, kafka_topic, tiny_model_dir
    ) as running:
        yield running
