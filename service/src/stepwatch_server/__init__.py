"""stepwatch-server: the stepwatch collector (ingest, storage, read API).

from stepwatch_server import Settings, create_app
app = create_app(Settings(database_url="sqlite:///./stepwatch.db"))
"""

from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings

__all__ = ["Settings", "create_app"]
