"""What the stand-in's endpoints answer with, whichever part serves them: Nomad's plain-text
errors with a status code (`ApiError`), the query meta of a write, the default namespace."""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]

NAMESPACE = "default"


class ApiError(Exception):
    """An answer Nomad gives as a plain-text body with a status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def write_meta(index: int) -> Json:
    return {"Index": index, "LastContact": 0, "KnownLeader": False, "NextToken": ""}
