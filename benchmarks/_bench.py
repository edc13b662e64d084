"""What the Python benchmarks share: a zoffloadd of their own on a temporary socket, and a free
port for torch.distributed's rendezvous."""
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def daemon_path():
    return os.environ.get("ZOFFLOADD", os.path.join(ROOT, "build-test/daemon/zoffloadd"))


def start_daemon(path, threads, tmp, who):
    """zoffloadd with threads workers and the pinned tier only, its socket and log in tmp."""
    sock = os.path.join(tmp, "sock")
    conf = os.path.join(tmp, "zoffload.conf")
    with open(conf, "w") as f:
        json.dump({"compute": {"worker_threads": threads}, "memory": {"policy": "cpu"}}, f)
    log = open(os.path.join(tmp, "daemon.log"), "w")
    proc = subprocess.Popen([path, "--config", conf, "--socket", sock], stdout=log, stderr=log)
    deadline = time.monotonic() + 10
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{who}: zoffloadd did not start; see {log.name}")
        time.sleep(0.01)
    # The socket file exists from bind(); the daemon accepts once it has listened.
    time.sleep(0.2)
    return proc, sock


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
