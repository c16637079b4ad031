"""What a credential looks like in a model's source or in any text llmgw shows: refused in
sources (`spec.source_problem`), and masked as `***` wherever a source or an engine's error is
shown (the router, the admin API, ctl, logs, the Consul UI)."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

# Query parameters that carry a credential or a signature (AWS SigV4 presigned URLs, go-getter's
# s3 options, the usual token names). Matched case-insensitively.
SECRET_PARAMS = frozenset(
    p.lower()
    for p in (
        "X-Amz-Signature",
        "X-Amz-Credential",
        "X-Amz-Security-Token",
        "aws_access_key_id",
        "aws_access_key_secret",
        "aws_access_token",
        "token",
        "access_token",
        "auth",
        "sig",
        "signature",
        "secret",
        "password",
        "api_key",
        "apikey",
        "key",
    )
)


SECRETS_HINT = (
    "sources are shown to clients, operators and logs, so credentials never go in one: put them "
    "in a Nomad Variable and into the engine's environment (e.g. HF_TOKEN or AWS_ACCESS_KEY_ID) "
    "through a template; see docs/models.md, 'Credentials for sources'"
)


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@")


_SECRET_QUERY = re.compile(
    r"(?i)([?&;](?:" + "|".join(re.escape(p) for p in sorted(SECRET_PARAMS)) + r")=)[^&;#\s'\"]+"
)


_TOKENS = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+|\bhf_[A-Za-z0-9]{8,}|\bAKIA[0-9A-Z]{16}\b")


def redact(text: str) -> str:
    """`text` with anything credential-shaped replaced by `***`: passwords in URLs, secret query
    parameters, bearer tokens, Hugging Face and AWS key IDs. Used wherever a source or an engine's
    error is shown, behind the validation that refuses them in sources."""
    if not text:
        return text
    text = _USERINFO.sub(r"\1***@", text)
    text = _SECRET_QUERY.sub(r"\1***", text)
    return _TOKENS.sub(lambda m: (m.group(1) + "***") if m.group(1) else "***", text)


def source_credentials(source: str) -> str | None:
    """What in `source` is a credential (named, never shown), or None."""
    parts = urlsplit(source)
    if "@" in parts.netloc:
        return "a user name or password before '@'"
    found = sorted(
        {k for k, _ in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in SECRET_PARAMS}
    )
    if found:
        return f"the query parameter{'s' if len(found) > 1 else ''} {', '.join(found)}"
    return None
