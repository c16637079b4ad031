"""Where a fetch reads a model's weights from, and with which credentials.

A source is what a definition's `source` says. Remote kinds become one HTTP(S) URL and the
headers that authorise a GET of it; the credentials come from the fetch's environment, which
the fetch task's template fills from the model's Nomad Variable (fetch/render.py):

- `https://` / `http://`: `LLMGW_SOURCE_TOKEN`, sent as a bearer token.
- `hf://ORG/REPO[@REV]/PATH`: Hugging Face's resolve URL (`HF_ENDPOINT` for a mirror), `HF_TOKEN`.
- `s3://BUCKET/KEY[?region=R][&endpoint=URL]`: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
  `AWS_SESSION_TOKEN`, signed with SigV4; `endpoint` (or `AWS_ENDPOINT_URL_S3`,
  `AWS_ENDPOINT_URL`) for an S3-compatible store, addressed path-style.
- `file://PATH` or `/PATH`: a file the node can already read, copied into the cache.

`?checksum=sha256:HEX` (go-getter's spelling, so a definition keeps its meaning) is checked after
the download and never sent to the source.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from nomad_driver.fetch.sigv4 import sign_get

REMOTE_SCHEMES = ("http", "https", "s3", "hf")
HF_DEFAULT_ENDPOINT = "https://huggingface.co"


class SourceError(ValueError):
    """A source the fetch cannot read at all (a directory, an unknown scheme)."""


@dataclass(frozen=True)
class Source:
    text: str
    kind: str  # "http", "s3", "hf" or "file"
    url: str  # the URL fetched, or the local path for "file"
    file_name: str
    sha256: str | None
    env: Mapping[str, str]
    region: str = ""

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The request headers for a GET, `extra` (Range) included."""
        extra = dict(extra or {})
        if self.kind == "s3":
            key, secret = self.env.get("AWS_ACCESS_KEY_ID", ""), self.env.get("AWS_SECRET_ACCESS_KEY", "")
            if key and secret:
                return sign_get(
                    self.url,
                    access_key=key,
                    secret_key=secret,
                    region=self.region,
                    session_token=self.env.get("AWS_SESSION_TOKEN", ""),
                    extra=extra,
                )
            return extra
        token = self.env.get("HF_TOKEN" if self.kind == "hf" else "LLMGW_SOURCE_TOKEN", "")
        if token:
            extra["Authorization"] = f"Bearer {token}"
        return extra


def is_fetched(source: str) -> bool:
    """Whether llmgw's fetch brings this source to the node: one remote file. A directory (an
    S3 prefix for vLLM) and a whole `hf://ORG/REPO` (vLLM resolves it itself) are not."""
    parts = urlsplit(source)
    if parts.scheme not in REMOTE_SCHEMES or source.endswith("/"):
        return False
    if parts.scheme == "hf":
        return len([s for s in (parts.netloc + parts.path).split("/") if s]) > 2
    return True


def local_path(source: str) -> str | None:
    """The node path a `file://` source names, or None for any other source."""
    parts = urlsplit(source)
    return unquote(parts.netloc + parts.path) if parts.scheme == "file" else None


def parse_source(text: str, env: Mapping[str, str] | None = None) -> Source:
    env = dict(os.environ if env is None else env)
    if text.endswith("/"):
        raise SourceError(f"source {text!r} is a directory; llmgw fetch downloads one file")
    parts = urlsplit(text)
    query = dict(parse_qsl(parts.query))
    checksum = query.pop("checksum", "")
    sha256 = None
    if checksum:
        algo, _, digest = checksum.partition(":")
        if algo != "sha256" or not digest:
            raise SourceError(f"checksum {checksum!r}: only sha256:HEX is checked")
        sha256 = digest.lower()
    name = posixpath.basename(unquote(parts.path).rstrip("/")) or "model"
    if parts.scheme in ("", "file"):
        path = unquote(parts.netloc + parts.path) if parts.scheme == "file" else text
        return Source(text, "file", path, name, sha256, env)
    if parts.scheme in ("http", "https"):
        rest = urlencode(query)
        url = f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{rest}" if rest else "")
        return Source(text, "http", url, name, sha256, env)
    if parts.scheme == "hf":
        segments = [s for s in (parts.netloc + parts.path).split("/") if s]
        if len(segments) < 3:
            raise SourceError(f"source {text!r} names a whole repository; llmgw fetch needs a file in it")
        org, repo, *in_repo = segments
        revision = "main"
        if "@" in repo:
            repo, revision = repo.split("@", 1)
        endpoint = env.get("HF_ENDPOINT", HF_DEFAULT_ENDPOINT).rstrip("/")
        url = f"{endpoint}/{org}/{repo}/resolve/{revision}/{'/'.join(in_repo)}"
        return Source(text, "hf", url, name, sha256, env)
    if parts.scheme == "s3":
        region = (
            query.pop("region", "") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        )
        endpoint = (
            query.pop("endpoint", "") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL", "")
        )
        endpoint = (endpoint or f"https://s3.{region}.amazonaws.com").rstrip("/")
        rest = urlencode(query)
        url = f"{endpoint}/{parts.netloc}{parts.path}" + (f"?{rest}" if rest else "")
        return Source(text, "s3", url, name, sha256, env, region=region)
    raise SourceError(f"source {text!r}: unsupported scheme {parts.scheme!r}")
