"""What a client installs: the SDK stands alone, without the server side."""

import subprocess
import sys

CHECK = """
import sys
import tollgate
from tollgate import AsyncClient, Client, RunEvent, TollgateError
import tollgate.commands
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('services', 'engine', 'torch', 'sqlalchemy'))
print(loaded)
"""


def test_the_sdk_and_client_commands_import_no_server_code() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
