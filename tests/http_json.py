"""POST a JSON body to a test's HTTP server and read its JSON answer, errors included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def post_json(url: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    """(HTTP status, decoded JSON reply) of POST `body` (a dict, or raw bytes as they are),
    with `headers` besides the JSON content type."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
