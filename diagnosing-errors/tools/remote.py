"""Run one shell command on many hosts at once over ssh (for dump_hang.py and cluster_top.py)."""
import subprocess
from concurrent.futures import ThreadPoolExecutor

# NOTE: BatchMode fails at once instead of asking for a password that nobody types.
SSH = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]


def read_hosts(path):
    """One host per line; blank lines and # comments are skipped."""
    with open(path) as f:
        return [h for h in (line.split("#")[0].strip() for line in f) if h]


def run_on_hosts(hosts, command, timeout=30):
    """{host: (returncode, stdout, stderr)}; localhost runs without ssh."""
    def run(host):
        argv = ["bash", "-c", command] if host == "localhost" else SSH + [host, command]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
            return p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired:
            return 124, "", f"no answer within {timeout} s"

    with ThreadPoolExecutor(max_workers=min(64, len(hosts) or 1)) as pool:
        return dict(zip(hosts, pool.map(run, hosts)))
