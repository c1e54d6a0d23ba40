import asyncio

from services.worker.app import main

asyncio.run(main())
