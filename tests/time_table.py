"""Writes the table of each test file's time into tests/README.md, from tests/times.json, which conftest.py writes at
the end of every run of the whole suite (`python -m pytest tests`, or `bash .ci/run`).

    python tests/time_table.py          # rewrite the table between its markers
    python tests/time_table.py --check  # exit 1 if the table is not what tests/times.json gives
"""

import json
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
README = TESTS / "README.md"
BEGIN, END = "<!-- table: test times, written by tests/time_table.py -->", "<!-- end of table -->"


def table(times):
    files = sorted(times["files"].items(), key=lambda item: -item[1])
    cpu = times.get("cpu_s", {})
    lines = [BEGIN, "", "| file | seconds | share | CPU seconds |", "| --- | ---: | ---: | ---: |"]
    tests_total = sum(times["files"].values())
    for name, seconds in files:
        lines.append(f"| `{Path(name).name}` | {seconds:,.0f} | {seconds / tests_total:.0%} | "
                     f"{cpu.get(name, 0):,.0f} |")
    background = {name: seconds for name, seconds in cpu.items() if not name.startswith("tests/")}
    lines += [f"| {name} | | | {seconds:,.0f} |" for name, seconds in background.items()]
    lines += [f"| **pytest, in all** | **{times['total_s']:,.0f}** | | **{sum(cpu.values()):,.0f}** |", "",
              f"{times['tests']} tests on {times['machine']}, {workers(times)}, warm start "
              f"{'on' if times['warm_start'] else 'off'}; "
              f"that run's budget was {times['budget_s']:,} s (conftest.py's `SUITE_BUDGET_S`); the cores were idle "
              f"{times.get('cpu_idle_share') or 0:.0%} of the time. CPU seconds are a file's tests' own and those of "
              f"the processes they started warm (not the few started cold). The slowest tests:", ""]
    slowest = list(times["slowest"].items())[:8]
    lines += [f"* {seconds:,.0f} s `{nodeid.replace('tests/', '', 1)}`" for nodeid, seconds in slowest]
    return "\n".join([*lines, "", END])


def workers(times):
    count = times.get("workers", 1)
    return "in one process" if count == 1 else (f"{count} pytest-xdist workers (a file's seconds are its tests', run "
                                                f"beside another worker's)")


def main():
    if not (TESTS / "times.json").exists():
        sys.exit("error: no tests/times.json: a run of the whole suite writes it (python -m pytest tests)")
    times = json.loads((TESTS / "times.json").read_text())
    text = README.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        sys.exit(f"error: {README} has no table between {BEGIN} and {END}")
    new = pattern.sub(lambda match: table(times), text)
    if "--check" in sys.argv[1:]:
        if new != text:
            sys.exit("error: tests/README.md's table is not tests/times.json's: run python tests/time_table.py")
        return
    README.write_text(new)


if __name__ == "__main__":
    main()
