"""Cloud clients bound to the job's project: gcsfs options (for ``paths``) and BigQuery (for ``data``).

The project always comes from :func:`vertexrt.env.project_id`, never from the VM's credentials (inside a
Vertex job they name a Google-managed tenant project). ``STORAGE_EMULATOR_HOST`` and
``BIGQUERY_EMULATOR_HOST`` point the clients at local servers with anonymous credentials.

Example:
    >>> import gcsfs, vertexrt
    >>> fs = gcsfs.GCSFileSystem(**vertexrt.storage_options())
    >>> rows = vertexrt.bigquery_client().query("SELECT 1").result()
"""

from __future__ import annotations

import os

from vertexrt.env import project_from_environ, project_id
from vertexrt.errors import ConfigError

TYPE_CHECKING = False  # `typing` stays off the import path
if TYPE_CHECKING:
    from typing import Any

    from google.cloud import bigquery


def storage_options(project: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``gcsfs.GCSFileSystem`` bound to the resolved project.

    With ``STORAGE_EMULATOR_HOST`` set they point at the emulator with anonymous credentials.

    Example:
        >>> fs = gcsfs.GCSFileSystem(**vertexrt.storage_options())
    """
    options: dict[str, Any] = {}
    resolved = project or project_from_environ()
    if resolved:
        options["project"] = resolved
    emulator = emulator_endpoint()
    if emulator:
        options["endpoint_url"] = emulator
        options["token"] = "anon"
    return options


def emulator_endpoint() -> str | None:
    """``STORAGE_EMULATOR_HOST`` with its scheme (``http://`` added if missing), or None.

    Example:
        >>> os.environ["STORAGE_EMULATOR_HOST"] = "127.0.0.1:4443"; emulator_endpoint()
        'http://127.0.0.1:4443'
    """
    return _endpoint("STORAGE_EMULATOR_HOST")


def bigquery_client(project: str | None = None, **kwargs: Any) -> bigquery.Client:
    """A ``google.cloud.bigquery.Client`` bound to :func:`vertexrt.env.project_id`.

    ``BIGQUERY_EMULATOR_HOST`` (``http://host:port``) points it at a local server with anonymous
    credentials.

    Raises:
        ConfigError: no project resolves, or no Google credentials are found (the message names the fix).

    Example:
        >>> rows = vertexrt.bigquery_client().query("SELECT 1").result()
    """
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import bigquery

    endpoint = _endpoint("BIGQUERY_EMULATOR_HOST")
    if endpoint:
        from google.auth.credentials import AnonymousCredentials

        kwargs.setdefault("client_options", {"api_endpoint": endpoint})
        kwargs.setdefault("credentials", AnonymousCredentials())
    resolved = project_id(project)
    try:
        return bigquery.Client(project=resolved, **kwargs)
    except DefaultCredentialsError as exc:
        raise ConfigError(
            f"bigquery_client(): no Google credentials for project {resolved!r} ({exc}). Locally run "
            "`gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service "
            "account key file, or BIGQUERY_EMULATOR_HOST=http://host:port for a local server; in a Vertex "
            "job the job's service account provides them"
        ) from exc


def _endpoint(name: str) -> str | None:
    host = os.environ.get(name, "").strip()
    if not host or host == "default":
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"
