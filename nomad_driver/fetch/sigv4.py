"""AWS Signature Version 4 for one S3 GET, in the Authorization header.

Hand-written rather than botocore, so that the fetch streams every source through one HTTP path
(Range resume, the stall rule) and llmgw needs no AWS SDK on a GPU node. The algorithm is AWS's
"Signature Version 4 signing process" (docs.aws.amazon.com/IAM/latest/UserGuide/create-signed-request.html);
the body is never signed (UNSIGNED-PAYLOAD), which S3 accepts over HTTPS and HTTP alike.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime
from urllib.parse import quote, urlsplit

UNSIGNED = "UNSIGNED-PAYLOAD"


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sign_get(
    url: str,
    *,
    access_key: str,
    secret_key: str,
    region: str,
    session_token: str = "",
    extra: dict[str, str] | None = None,
    now: datetime | None = None,
) -> dict[str, str]:
    """The headers that sign a GET of `url` (plus `extra`, e.g. Range, which are sent unsigned)."""
    now = now or datetime.now(UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = now.strftime("%Y%m%d")
    parts = urlsplit(url)
    host = parts.netloc
    path = quote(parts.path or "/", safe="/-_.~")
    query = "&".join(sorted(q for q in parts.query.split("&") if q))
    signed = {"host": host, "x-amz-content-sha256": UNSIGNED, "x-amz-date": amz_date}
    if session_token:
        signed["x-amz-security-token"] = session_token
    names = sorted(signed)
    canonical = "\n".join(
        [
            "GET",
            path,
            query,
            "".join(f"{n}:{signed[n]}\n" for n in names),
            ";".join(names),
            UNSIGNED,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), day), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers = {k: v for k, v in signed.items() if k != "host"}
    headers["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={';'.join(names)}, "
        f"Signature={signature}"
    )
    return {**headers, **(extra or {})}
