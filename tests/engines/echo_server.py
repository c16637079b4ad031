"""The echo engine's server: an OpenAI-style chat completion that repeats the last user
message, ready at /ready once it has read its weights file (standard library only, so the
install needs no virtualenv).

    python echo_server.py --model PATH --name NAME --host HOST --port PORT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    opts = parser.parse_args()
    try:
        Path(opts.model).read_bytes()
    except OSError as exc:
        # The words a watcher keeps as the reason it parks the model.
        print(f"error loading model: {exc}", file=sys.stderr)
        return 1

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/ready":
                self._json({"status": "ok"})
            elif self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": opts.name, "object": "model"}]})
            else:
                self._json({"error": {"message": "not found"}}, 404)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path != "/v1/chat/completions":
                self._json({"error": {"message": "not found"}}, 404)
                return
            said = [m.get("content", "") for m in body.get("messages", []) if m.get("role") == "user"]
            message = {"role": "assistant", "content": said[-1] if said else ""}
            self._json(
                {
                    "id": "echo-1",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": opts.name,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                }
            )

        def _json(self, doc: dict[str, Any], status: int = 200) -> None:
            raw = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    ThreadingHTTPServer((opts.host, opts.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
