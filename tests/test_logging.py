"""The one logging setup (meshtrain/log.py) in a process as a node runs it: configured first, then
py-libp2p imported — which resets its own loggers."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import ROOT

SCRIPT = """
import logging
from meshtrain.log import configure
configure("INFO")
import meshtrain.transport.host  # imports py-libp2p, which resets its loggers
logging.getLogger("libp2p.network.swarm").error("fail to upgrade mux for peer X")
logging.getLogger("libp2p.host.basic_host").error("Failed to open stream to peer X:")
logging.getLogger("libp2p.network.auto_connector").info("AUTO_CONNECTOR_STATE")  # sets its own level: INFO
logging.getLogger("meshtrain.node").info("ours")
"""


def _run(**extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MESHTRAIN_LOG_LIBP2P"} | extra
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_py_libp2p_errors_do_not_reach_the_console_as_bare_lines():
    """Every node's console showed py-libp2p's dial errors as bare lines (Python's last-resort
    handler: py-libp2p's logger did not propagate and had no handler of its own)."""
    err = _run()
    assert "fail to upgrade mux" not in err and "Failed to open stream" not in err, err
    assert "AUTO_CONNECTOR" not in err, err
    assert "INFO meshtrain.node ours" in err


def test_py_libp2p_debug_output_comes_through_our_formatter_when_asked():
    err = _run(MESHTRAIN_LOG_LIBP2P="1")
    assert "ERROR libp2p.network.swarm fail to upgrade mux for peer X" in err, err
