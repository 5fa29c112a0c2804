"""A TEST DOUBLE of an OpenAI-compatible chat endpoint, for the harness recipe tests: not
a model server, not rolloutd's endpoint.

``POST /v1/chat/completions`` answers with scripted assistant replies, one per request in
order (the last one repeats); a reply starting with ``HTTP400:`` is answered as a 400 API
error instead. Every request (time, path, headers, JSON body) is appended to a JSONL log.
Standard library only, so it runs with any python3 inside a sandbox, on the sandbox's own
loopback.

    python3 _fake_openai.py PORT_FILE REPLIES_JSON LOG_JSONL

It listens on a free port of 127.0.0.1 and writes that port to PORT_FILE when ready.
"""

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    port_file, replies_path, log_path = sys.argv[1:4]
    with open(replies_path) as f:
        replies = json.load(f)
    served = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with open(log_path, "a") as f:
                f.write(json.dumps({"t": time.time(), "path": self.path,
                                    "headers": dict(self.headers), "body": body}) + "\n")
            reply = replies[min(served[0], len(replies) - 1)]
            served[0] += 1
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": {"message": "not found", "code": 404}})
            elif reply.startswith("HTTP400:"):
                self._send(400, {"error": {"message": reply[len("HTTP400:"):],
                                           "type": "invalid_request_error", "code": 400}})
            else:
                self._send(200, {
                    "id": f"chatcmpl-fake{served[0]}", "object": "chat.completion",
                    "created": int(time.time()), "model": body.get("model", "fake"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": reply}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                })

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tmp = port_file + ".part"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
