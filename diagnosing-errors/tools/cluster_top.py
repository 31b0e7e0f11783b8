"""GPU utilization, memory, power and temperature of every host in a hosts file, refreshed like top.

    python diagnosing-errors/tools/cluster_top.py hosts           # refresh every 2 s, Ctrl-C quits
    python diagnosing-errors/tools/cluster_top.py hosts --once    # one snapshot, for a log

One line per host, with every GPU's utilization side by side so that the one idle
GPU of a busy job stands out (a hung or dead rank, or a straggler's partners
waiting for it). Needs passwordless ssh (BatchMode) and nvidia-smi on each host;
`localhost` runs without ssh.
"""
import argparse
import statistics
import sys
import time

import remote

FIELDS = "index,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu"
QUERY = f"nvidia-smi --query-gpu={FIELDS} --format=csv,noheader,nounits"


def number(text):
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse(out):
    keys = FIELDS.split(",")
    return [dict(zip(keys, map(number, line.split(",")))) for line in out.strip().splitlines()]


def flags(gpus, busy, n_expected):
    out = []
    if len(gpus) != n_expected:
        out.append(f"{len(gpus)} GPUs, others have {n_expected} (fell off the bus? dmesg | grep -i xid)")
    for g in gpus:
        name = f"gpu{g['index']:.0f}"
        if busy and (g["utilization.gpu"] or 0) < 10:
            out.append(f"{name} idle")
        if (g["temperature.gpu"] or 0) >= 85:
            out.append(f"{name} {g['temperature.gpu']:.0f}C")
        if g["memory.total"] and g["memory.used"] / g["memory.total"] > 0.98:
            out.append(f"{name} memory full")
    return ", ".join(out)


def render(results):
    ok = {h: parse(out) for h, (rc, out, err) in results.items() if rc == 0 and out.strip()}
    utils = [g["utilization.gpu"] or 0 for gpus in ok.values() for g in gpus]
    busy = bool(utils) and statistics.mean(utils) >= 50  # NOTE: "idle" only means something when the job is busy
    n_expected = statistics.mode(len(g) for g in ok.values()) if ok else 0
    width = max(len(h) for h in results)
    lines = [f"{time.strftime('%H:%M:%S')}  {len(results)} hosts, {len(utils)} GPUs, "
             f"mean utilization {statistics.mean(utils) if utils else 0:.0f}%",
             f"{'HOST':<{width}}  {'UTIL% PER GPU':<32}  {'MEM GiB':>11}  {'POWER W':>7}  {'MAX C':>5}  FLAGS"]
    for host, (rc, out, err) in results.items():
        if host not in ok:
            reason = (err.strip().splitlines() or [f"exit code {rc}"])[-1]
            lines.append(f"{host:<{width}}  unreachable: {reason}")
            continue
        gpus = ok[host]
        util = " ".join(f"{g['utilization.gpu'] or 0:3.0f}" for g in gpus)
        memory = f"{sum(g['memory.used'] or 0 for g in gpus) / 1024:.0f}/{sum(g['memory.total'] or 0 for g in gpus) / 1024:.0f}"
        power = sum(g["power.draw"] or 0 for g in gpus)
        temp = max(g["temperature.gpu"] or 0 for g in gpus)
        lines.append(f"{host:<{width}}  {util:<32}  {memory:>11}  {power:7.0f}  {temp:5.0f}  "
                     f"{flags(gpus, busy, n_expected)}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hosts", help="file with one host per line")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args()
    hosts = remote.read_hosts(args.hosts)
    if args.once:
        print(render(remote.run_on_hosts(hosts, QUERY, timeout=15)))
        return
    try:
        while True:
            screen = render(remote.run_on_hosts(hosts, QUERY, timeout=15))
            sys.stdout.write("\033[H\033[2J" + screen + "\n")  # home + clear, like top
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
