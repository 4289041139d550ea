"""Seconds per step of a time-stamped CI log (tools/time_ci.sh): each top-level `+ cmd` line of bash -x starts a
step, which lasts until the next one starts (a step run in the background shows as its launch only).

    python tools/ci_phases.py WORKDIR/ci.log
"""
import re
import sys


def main(path: str) -> None:
    steps, end = [], None
    for line in open(path, errors="replace"):
        stamp = re.match(r"^(\d+) ", line)
        if stamp:
            end = int(stamp.group(1))
        step = re.match(r"^(\d+) \+ (.*)", line)
        if step:
            steps.append((int(step.group(1)), step.group(2)))
    if not steps:
        sys.exit(f"{path}: no `+ command` lines (was it written by tools/time_ci.sh?)")
    for (t, cmd), (t_next, _) in zip(steps, steps[1:] + [(end, "")]):
        if t_next - t >= 2:
            print(f"{t_next - t:6d} s  {cmd[:150]}")
    print(f"{end - steps[0][0]:6d} s  total")


if __name__ == "__main__":
    main(sys.argv[1])
