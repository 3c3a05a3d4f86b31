"""A stand-in for llama.cpp's ``llama-server`` with known costs: its HTTP API (``/health``, ``/completion``
with the timings llama-server reports) and ``--version``, so the llama.cpp paths run where llama.cpp is
not built.

Costs, in milliseconds: a target decode step :data:`TARGET_MS`, a draft step :data:`DRAFT_MS` (the
draft model alone steps at that too), and a round drafting K tokens ``K * DRAFT_MS + TARGET_MS +
VERIFY_MS_PER_TOKEN * K``; each round accepts ``K // 2`` of its drafted tokens. A calibration should
read these numbers back. Greedy outputs (``return_tokens``) are ``0, 1, 2, ...``, except that with a
draft the last token is :data:`FLIPPED`, at a target top-2 logit gap of :data:`TOP2_GAP` (``n_probs``).
"""

import json
import stat
import sys
from pathlib import Path

TARGET_MS, DRAFT_MS, VERIFY_MS_PER_TOKEN = 30.0, 10.0, 5.0
FLIPPED, TOP2_GAP = 999, 0.5
KNOWN = {"-m", "-md", "--host", "--port", "-c", "-t", "-tb", "-td", "-np", "--temp", "--no-webui", "--spec-type",
         "--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min"}


def install(folder: Path) -> Path:
    """An executable ``llama-server`` in ``folder`` that runs this file."""
    server = Path(folder) / "llama-server"
    server.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    server.chmod(server.stat().st_mode | stat.S_IEXEC)
    return server


def timings(n_predict: int, *, model: str, n_max: int) -> dict:
    """The ``timings`` of a greedy request for ``n_predict`` tokens."""
    decode = n_predict - 1  # the first token comes from the prompt's prefill
    if not n_max:
        step = DRAFT_MS if "draft" in Path(model).name else TARGET_MS
        return {"predicted_n": n_predict, "predicted_ms": step * decode}
    accepted_per_round = n_max // 2
    rounds = -(-decode // (accepted_per_round + 1))
    ms = rounds * (n_max * DRAFT_MS + TARGET_MS + VERIFY_MS_PER_TOKEN * n_max)
    return {"predicted_n": n_predict, "predicted_ms": ms, "draft_n": rounds * n_max,
            "draft_n_accepted": decode - rounds}


def serve(argv: list[str]) -> None:
    from http.server import BaseHTTPRequestHandler, HTTPServer

    if "--version" in argv:
        print("version: 1234 (abcdef0)\nbuilt with cc for x86_64")
        return
    unknown = [a for a in argv if a.startswith("-") and a not in KNOWN]
    if unknown:
        sys.exit(f"error: invalid argument: {unknown[0]}")
    port = int(argv[argv.index("--port") + 1])
    model = argv[argv.index("-m") + 1]
    n_max = int(argv[argv.index("--spec-draft-n-max") + 1]) if "-md" in argv and "--spec-draft-n-max" in argv else 0
    if "-md" in argv and "--spec-type" in argv and not n_max:
        n_max = 3  # llama.cpp's default draft length

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply({"status": "ok"})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = req["n_predict"]
            t = {**timings(n, model=model, n_max=n_max), "prompt_n": len(req["prompt"]), "prompt_ms": 1.0}
            body = {"content": "x" * n, "timings": t}
            if req.get("return_tokens"):
                body["tokens"] = list(range(n - 1)) + [FLIPPED if "-md" in argv else n - 1]
            if req.get("n_probs"):
                body["completion_probabilities"] = [
                    {"id": i, "logprob": -0.1, "top_logprobs": [{"id": i, "logprob": -0.1},
                                                                {"id": FLIPPED, "logprob": -0.1 - TOP2_GAP}]}
                    for i in range(n)]
            self._reply(body)

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(sys.argv[1:])
