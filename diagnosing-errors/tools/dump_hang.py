"""Print the Python stack of every rank of a hung job, grouped so the odd rank out stands out.

    python diagnosing-errors/tools/dump_hang.py                 # every job on this host
    python diagnosing-errors/tools/dump_hang.py PID             # torchrun's pid, or one rank's pid
    python diagnosing-errors/tools/dump_hang.py --hosts hosts   # every host in the file, over ssh

A rank is a Python process with RANK (torchrun) or SLURM_PROCID (srun) in its
environment. Each is dumped with `py-spy dump --json`; ranks whose main threads
have the same stack are printed as one group, smallest group first, with the
innermost line of your own code ("waits at"). In a hang the odd group is
usually the culprit: it is somewhere the others are not.

Needs py-spy (pip install py-spy) and permission to ptrace the ranks: run as the
job's user or root; in a container, start it with --cap-add SYS_PTRACE.
With --hosts this script must sit at the same path on every host (shared home).
"""
import argparse
import json
import linecache
import os
import shutil
import socket
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import remote


def read_environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().decode(errors="replace").split("\0")
    except OSError:  # gone, or another user's process
        return {}
    return dict(item.split("=", 1) for item in items if "=" in item)


def parent_pids():
    ppid = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            pass
    return ppid


def is_python(pid):
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
    except OSError:
        return False


def find_ranks(root=None):
    """{pid: environ} of the ranks under `root` (itself included), or on the whole host."""
    ppid = parent_pids()
    children = defaultdict(list)
    for pid, parent in ppid.items():
        children[parent].append(pid)
    if root is None:
        pids = set(ppid)
    else:
        pids, todo = set(), [root]
        while todo:
            pids.add(todo[-1])
            todo.extend(children[todo.pop()])
    me, ancestors = os.getpid(), set()
    while me in ppid:  # never dump ourselves: under srun we carry SLURM_PROCID too
        ancestors.add(me)
        me = ppid[me]
    env = {pid: read_environ(pid) for pid in pids - ancestors}
    ranks = {}
    for pid, e in env.items():
        launcher = "RANK" not in e and any("RANK" in env.get(c, {}) for c in children[pid])  # srun -> torchrun
        if ("RANK" in e or "SLURM_PROCID" in e) and not launcher and is_python(pid):
            ranks[pid] = e
    # DataLoader workers and other children inherit RANK: keep only the topmost process of each rank
    return {pid: e for pid, e in ranks.items() if rank_of(ranks.get(ppid.get(pid), {})) != rank_of(e)}


def rank_of(env):
    return env.get("RANK", env.get("SLURM_PROCID"))


def job_of(env):
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun run {run_id}"
    return f"job {env.get('SLURM_JOB_ID', '-')} master {env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"


def is_library(filename):
    return filename.startswith("<") or any(s in filename for s in ("/site-packages/", "/dist-packages/", "/lib/python3"))


def short(filename):
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    rel = os.path.relpath(filename)
    return filename if rel.startswith("..") else rel


def dump(pid, env):
    rec = {"host": socket.gethostname(), "pid": pid, "rank": int(rank_of(env)), "job": job_of(env)}
    try:
        p = subprocess.run(["py-spy", "dump", "--pid", str(pid), "--json"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        p = subprocess.CompletedProcess([], 1, "", "py-spy took over 60 s")
    if p.returncode != 0:
        rec["error"] = (p.stderr.strip().splitlines() or ["py-spy failed"])[0]
        return rec
    threads = json.loads(p.stdout)
    main = next((t for t in threads if t["os_thread_id"] == pid), threads[0])
    frames = [f for f in main["frames"] if not f["filename"].startswith("<frozen importlib")]  # import noise
    rec["frames"] = [(short(f["filename"]), f["line"], f["name"]) for f in frames]
    mine = next((f for f in frames if not is_library(f["filename"])), None)
    if mine:
        code = linecache.getline(mine["filename"], mine["line"]).strip()
        rec["waits_at"] = f"{short(mine['filename'])}:{mine['line']} in {mine['name']}: {code}"
    return rec


def ranges(ranks):
    """[0, 1, 2, 5] -> '0-2,5'"""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def report(records):
    jobs = defaultdict(list)
    for r in records:
        jobs[r["job"]].append(r)
    for job, recs in jobs.items():
        groups = defaultdict(list)
        for r in recs:
            groups[json.dumps(r.get("frames") or r["error"])].append(r)
        ordered = sorted(groups.values(), key=lambda g: (len(g), min(r["rank"] for r in g)))
        biggest = len(ordered[-1])
        hosts = {r["host"] for r in recs}
        print(f"== {job}: {len(recs)} ranks on {len(hosts)} host(s), {len(groups)} different stack(s)")
        for g in ordered:
            g.sort(key=lambda r: r["rank"])
            ranks = [r["rank"] for r in g]
            where = ", ".join(f"{r['host']}:{r['pid']}" for r in g[:4]) + (", ..." if len(g) > 4 else "")
            odd = "  <- odd one out" if len(g) < biggest else ""
            print(f"-- rank{'s' if len(g) > 1 else ''} {ranges(ranks)} ({where}){odd}")
            r = g[0]
            if "error" in r:
                print(f"   py-spy failed: {r['error']}")
                continue
            print(f"   waits at {r.get('waits_at', '(library code only)')}")
            for filename, line, name in r["frames"]:
                print(f"     {name} ({filename}:{line})")
        print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pid", nargs="?", type=int, help="torchrun's pid or a rank's pid (default: all ranks here)")
    parser.add_argument("--hosts", help="file with one host per line: dump every host over ssh")
    parser.add_argument("--json", action="store_true", help="print raw records (what --hosts collects)")
    args = parser.parse_args()

    if args.hosts:
        cmd = f"{sys.executable} {os.path.abspath(__file__)} --json"
        records = []
        for host, (rc, out, err) in remote.run_on_hosts(remote.read_hosts(args.hosts), cmd, timeout=120).items():
            if rc == 0:
                records += json.loads(out)
            else:
                print(f"{host}: {err.strip() or 'no ranks found'}", file=sys.stderr)
    else:
        if shutil.which("py-spy") is None:
            sys.exit("py-spy not found: pip install py-spy")
        ranks = find_ranks(args.pid)
        with ThreadPoolExecutor(max_workers=16) as pool:
            records = list(pool.map(lambda kv: dump(*kv), ranks.items()))
    if args.json:
        print(json.dumps(records))
    elif records:
        report(records)
    if not records:
        sys.exit("no ranks found (Python processes with RANK or SLURM_PROCID in their environment)")


if __name__ == "__main__":
    main()
