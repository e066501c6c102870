"""`jointrl serve-reward --term NAME [--config X] [--host 127.0.0.1] [--port P]`: one reward term of a
config served over HTTP (the protocol of tasks/rewards/http.py), for runs whose term is `fn: http`.

The term is built once, as a reward actor builds it, and scores one request at a time. The server
binds the loopback address unless told otherwise; bound to any other address it requires a bearer
token, read from JOINTRL_REWARD_TOKEN (never from the command line, where `ps` shows it), as Ray's
token authentication does for the cluster; with the variable set it requires it on any address.
A request larger than `--max-request-mb` is refused (413), one that is not the protocol answered
400 with a one-line reason, a term that raises 500 with its error (the run's reward guard retries
and counts it).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np

from common.config import SettingError
from common.loading import one_line
from tasks.rewards.http import TOKEN_ENV, read_body


def loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (socket.gaierror, ValueError):
        return False


class RewardServer(HTTPServer):
    """An HTTP server of one term's scorer (`score(images, prompts, refinements)`)."""

    def __init__(self, address, *, name: str, fn: str, scorer, token: str | None, max_bytes: int):
        super().__init__(address, RewardHandler)
        self.name, self.fn, self.scorer, self.token, self.max_bytes = name, fn, scorer, token, max_bytes

    @property
    def routes(self) -> dict:
        """POST /<route> -> what answers it: the scorer, and its strict correctness where it has one."""
        strict = getattr(self.scorer, "strict", None)
        return {"score": self.scorer, **({"strict": strict} if strict is not None else {})}


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer

    def log_message(self, format, *args):  # one line per request on stderr only when asked
        if os.environ.get("JOINTRL_SERVE_LOG"):
            super().log_message(format, *args)

    def answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def authorised(self) -> bool:
        token = self.server.token
        given = self.headers.get("Authorization", "")
        if token is None or hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return True
        self.answer(401, {"error": "a bearer token is required (Authorization: Bearer <token>)"})
        return False

    def do_GET(self):
        if not self.authorised():
            return
        if self.path.rstrip("/") != "/health":
            return self.answer(404, {"error": f"no {self.path}: GET /health, POST /score"})
        self.answer(200, {"term": self.server.name, "fn": self.server.fn, "strict": "strict" in self.server.routes})

    def do_POST(self):
        if not self.authorised():
            return
        what, routes = self.path.rstrip("/").lstrip("/"), self.server.routes
        if what not in routes:
            return self.answer(404, {"error": f"no {self.path}: GET /health, "
                                              f"{', '.join(f'POST /{r}' for r in routes)}"})
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self.answer(411, {"error": "a Content-Length is required"})
        if length > self.server.max_bytes:
            self.close_connection = True
            return self.answer(413, {"error": f"the request holds {length} bytes; this server takes at most "
                                              f"{self.server.max_bytes} (--max-request-mb)"})
        try:
            images, prompts, refinements = read_body(json.loads(self.rfile.read(length)))
        except ValueError as e:
            return self.answer(400, {"error": " ".join(str(e).split())[:400]})
        try:
            scores = np.asarray(routes[what](images, prompts, refinements), dtype=np.float64)
        except Exception as e:  # the term's own failure: the client's guard counts it
            return self.answer(500, {"error": f"reward.terms.{self.server.name}: {one_line(e)}"})
        self.answer(200, {"scores" if what == "score" else what: [float(s) if np.isfinite(s) else None for s in scores]})


def server_for(config, name: str, term, *, host: str, port: int, max_request_mb: float) -> RewardServer:
    """The term `name` of `config` built and bound (not yet serving); SettingError for what is the user's."""
    from driver.preflight import hub_problems, term_problems
    from driver.download import term_models
    from experts.devices import local_device
    from tasks.rewards import resolve
    from tasks.rewards.term import build_scorer, sample_scorer
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not loopback(host):
        raise SettingError(f"--host {host}: a server on an address other than the loopback requires a bearer "
                           f"token: set {TOKEN_ENV} (clients send it from their own {TOKEN_ENV})")
    if term.fn == "http":
        raise SettingError(f"--term {name}: it is itself scored by a server (fn: http); serve the term it names")
    if not getattr(resolve(term.fn), "prompt_files", True):
        raise SettingError(f"--term {name}: {term.fn} scores its own task's prompt records, which do not travel "
                           f"over HTTP (prompts travel as text and metadata)")
    if problems := term_problems(f"reward.terms.{name}", term) or hub_problems(term_models(name, term)):
        raise SettingError("; ".join(problems))
    scorer = sample_scorer(term, build_scorer(term, local_device(), name))
    try:
        return RewardServer((host, port), name=name, fn=term.fn, scorer=scorer, token=token,
                            max_bytes=int(max_request_mb * 2 ** 20))
    except OSError as e:
        raise SettingError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def run_serve_reward(args) -> int:
    from driver.commands.score import term_config
    config, term = term_config(args.config, args.overrides, args.term)
    server = server_for(config, args.term, term, host=args.host, port=args.port,
                        max_request_mb=args.max_request_mb)
    host, port = server.server_address[:2]
    print(f"jointrl: serving reward term {args.term} ({term.fn}) at http://{host}:{port}"
          f"{' (bearer token required)' if server.token else ''}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("jointrl: reward server stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        server.server_close()
    return 0
