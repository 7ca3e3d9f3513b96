"""The router's OpenAI-compatible HTTP API with the official OpenAI Node
client (tests/openai_client_test.mjs): starts the stack with --http_port and
--api_key, runs the client's checks, then checks that an aborted stream
left no session behind (router in-flight, target and speculator sessions
back to 0). Needs SPECSERVE_NODE_MODULES (tools/install_npm_deps.sh)."""

import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stack import Stack, wait_until  # noqa: E402

API_KEY = "e2e-test-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    nm = os.environ.get("SPECSERVE_NODE_MODULES", "")
    if not nm or not os.path.isdir(os.path.join(nm, "openai")):
        print("FAIL: SPECSERVE_NODE_MODULES=%r has no `openai` package; run "
              "`export SPECSERVE_NODE_MODULES=$(bash tools/install_npm_deps.sh)`"
              " (tools/test.sh does)" % nm)
        return 1
    port = free_port()
    with Stack(router_args=["--http_port", str(port), "--host", "127.0.0.1",
                            "--api_key", API_KEY]) as st:
        r = subprocess.run(
            ["node", "tests/openai_client_test.mjs", nm,
             "http://127.0.0.1:%d/v1" % port, API_KEY],
            timeout=300)
        if r.returncode != 0:
            print("FAIL: the OpenAI client checks failed (rc %d)" % r.returncode)
            for s in st.services:
                sys.stdout.write("".join(s.log[-20:]))
            return 1

        def idle():
            return (st.router.metric_value("specserve_router_in_flight_requests") == 0
                    and st.target.metric_value("specserve_target_active_sessions") == 0
                    and st.speculator.metric_value(
                        "specserve_speculator_active_sessions") == 0)
        if not wait_until(idle, 10):
            print("FAIL: sessions left after the aborted stream")
            return 1
        # The 12 generation requests the client made (errors rejected before
        # admission are not requests).
        ok = st.router.metric_value("specserve_router_requests_total")
        print("router requests counted: %s" % ok)
        if not ok or ok < 12:
            print("FAIL: HTTP requests are not counted by the router's metrics")
            return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
