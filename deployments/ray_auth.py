"""Ray's token authentication, as a client of its dashboard (Serve status, the Jobs API) sees it.

Ray (>= 2.59) turns token authentication on for new local clusters and generates the token; every
control-plane call and every dashboard request must then carry it. This project keeps it on
(``./run`` exports ``RAY_AUTH_MODE=token``; SECURITY.md). The token is found where Ray documents:
``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token``.
"""

from __future__ import annotations

import os
from pathlib import Path


def auth_token() -> str | None:
    """The cluster's token, or None when authentication is disabled or no token exists yet."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def auth_headers() -> dict[str, str]:
    """The headers a dashboard request carries: ``Authorization: Bearer <token>`` when there is one."""
    token = auth_token()
    return {"authorization": f"Bearer {token}"} if token else {}
