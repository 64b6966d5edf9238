"""OpenAI-compatible HTTP server for a SpeculativeGenerator (needs the `serve` extra: FastAPI, uvicorn,
prometheus_client).

    from dflashkit.server import create_app
    app = create_app(SpeculativeGenerator.load(drafter="path/to/drafter"))
    uvicorn.run(app, port=8000)          # or: dflashkit serve --drafter path/to/drafter --port 8000
"""

from dflashkit.server.app import create_app
from dflashkit.server.errors import APIError
from dflashkit.server.service import ServerSettings

__all__ = ["APIError", "ServerSettings", "create_app"]
